"""The serving benchmark's HTTP client (``serving_bench.py --api http``): the same requests as
the gRPC client, through the OpenAI-compatible ``/v1/completions`` with SSE streaming (token-id
prompts, ``ignore_eos``, ``include_usage``), so HTTP and gRPC streaming compare on one workload.

Token counts come from the final usage chunk. Each SSE chunk is stamped as one token and the
last one takes the remainder, exact while the client keeps up (the server merges tokens into
fewer chunks only for a client that falls behind)."""

from __future__ import annotations

import json
import time

import httpx


class HttpTarget:
    """Stands where the gRPC stub does; ``run_one`` dispatches to ``run_one_http``."""

    def __init__(self, base_url: str, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None,
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=1024))

    async def close(self) -> None:
        await self.client.aclose()


async def run_one_http(target: HttpTarget, prompt, max_tokens, temperature,
                       stamps: list | None = None) -> int:
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, total = 0, 0
    async with target.client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                total = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                chunks += 1
                if stamps is not None:
                    stamps.append((time.perf_counter(), 1))
    if stamps and total > chunks:
        t, _ = stamps[-1]
        stamps[-1] = (t, 1 + total - chunks)
    return total
