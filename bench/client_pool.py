"""Streaming clients spread over processes, for the serving benchmarks (``bench.serving_bench``
W1 / W3, ``bench.w4_bench``): one asyncio client process cannot read 256 streams of every token
as fast as the server writes them (W1 streamed from one process: 15,676-17,340 tok/s, from eight:
27,563), and a benchmark must measure the server. Each process (spawned) runs its share of the
requests over its own connections (each may reach another API front end) from a common start
time, and reports the CPU it used (user + system) over the wall time it ran: a process near
100% is the limit of the run, not the server (``usage``: ``client_limited``).

Requests are ``(send offset s, prompt ids, max_tokens, temperature, stream_interval[, key[,
model]])`` (interval 0: the server's default; 100000: one message per request, an offline
client; key: a name of the request's own; model: a LoRA adapter's name, gRPC only); each comes
back as ``{"ok", "ttft", "e2e", "itls" (per token), "tokens", "end" (epoch s), "key"}`` or
``{"ok": False, "error", "key"}``. With ``digest`` (``"tokens"``, or ``"logprobs"``: the
requests ask for the sampled tokens' logprobs too) each result carries ``"digest"``, a hash of
its token ids (and logprobs' bits): two runs gave a request the same output when its digests
are equal (``--deterministic``, docs/determinism.md; ``digests`` / ``compare`` below)."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import struct
import time

BUSY = 0.9   # a client process this busy (CPU seconds per wall second) is the limit


def output_digest(token_ids: list[int], logprobs: list[float] | None = None) -> str:
    """A request's output as a short hash: its token ids and, when given, its logprobs' float32
    bits (the wire's)."""
    h = hashlib.sha256(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if logprobs is not None:
        h.update(struct.pack(f"<{len(logprobs)}f", *logprobs))
    return h.hexdigest()[:24]


async def _one(stub, target, pb, prompt, max_tokens: int, temperature: float, interval: int,
               start_at: float, key=None, model: str = "", digest: str | None = None) -> dict:
    await asyncio.sleep(max(0.0, start_at - time.time()))
    sent, stamps, ids, logprobs = time.perf_counter(), [], [], []
    try:
        if target is not None:   # HTTP SSE
            from bench.serving_http import run_one_http

            if digest:
                raise ValueError("output digests are taken over gRPC only")
            await run_one_http(target, prompt, max_tokens, temperature, stamps)
        else:
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                     ignore_eos=True, sampling=pb.SamplingParams(temperature=temperature),
                                     stream_interval=interval, model=model,
                                     logprobs=int(digest == "logprobs"))
            async for resp in stub.Generate(req, timeout=600):
                stamps.append((time.perf_counter(), len(resp.token_ids)))
                if digest:
                    ids.extend(resp.token_ids)
                    logprobs.extend(lp.logprob for lp in resp.logprobs)
    except Exception as exc:  # noqa: BLE001 - counted as failed
        return {"ok": False, "error": repr(exc)[:200], "key": key}
    if not stamps:
        return {"ok": False, "error": "no response", "key": key}
    itls = [(t1 - t0) / n for (t0, _), (t1, n) in zip(stamps, stamps[1:]) for _ in range(n)]
    out = {"ok": True, "ttft": stamps[0][0] - sent, "e2e": stamps[-1][0] - sent, "itls": itls,
           "tokens": sum(n for _, n in stamps), "end": time.time(), "key": key}
    if digest:
        out["digest"] = output_digest(ids, logprobs if digest == "logprobs" else None)
    return out


def _process(address: str, http_url: str | None, items: list, t0: float, channels: int,
             digest: str | None = None) -> dict:
    """One client process: its requests, and the CPU it used while they ran."""
    import grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    async def run():
        if http_url:
            from bench.serving_http import HttpTarget

            targets, stubs, chans = [HttpTarget(http_url)], [None], []
        else:
            chans = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                     for _ in range(channels)]
            targets, stubs = [None], [pb_grpc.InferenceStub(c) for c in chans]
        cpu0 = time.process_time()
        results = await asyncio.gather(*(
            _one(stubs[i % len(stubs)], targets[i % len(targets)], pb, p, m, temp, interval,
                 t0 + off, *rest, digest=digest)
            for i, (off, p, m, temp, interval, *rest) in enumerate(items)))
        cpu = time.process_time() - cpu0
        for c in chans:
            await c.close()
        for t in targets:
            if t is not None:
                await t.close()
        return results, cpu

    results, cpu = asyncio.run(run())
    end = max((r["end"] for r in results if r["ok"]), default=t0)
    return {"results": results, "cpu_s": cpu, "wall_s": max(end - t0, 1e-9)}


def run(address: str, items: list, processes: int, channels: int = 4, http_url: str | None = None,
        lead_s: float = 3.0, digest: str | None = None) -> tuple[list[dict], dict, float]:
    """Runs ``items`` from ``processes`` client processes (offset 0 is ``lead_s`` from now,
    after they started); returns every request's result, in no particular order, the clients'
    CPU use, and the epoch second that offset 0 was. ``digest``: see the module docstring."""
    processes = max(1, min(processes, len(items)))
    t0 = time.time() + lead_s
    shares = [items[i::processes] for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_process, [(address, http_url, s, t0, channels, digest) for s in shares])
    busy = [p["cpu_s"] / p["wall_s"] for p in parts]
    usage = {"client_processes": processes, "client_cpu_max": round(max(busy), 3),
             "client_cpu_mean": round(sum(busy) / len(busy), 3), "client_limited": max(busy) >= BUSY}
    return [r for p in parts for r in p["results"]], usage, t0


def digests(results: list[dict]) -> dict:
    """key -> digest of the results that finished (``run(..., digest=...)``)."""
    return {r["key"]: r["digest"] for r in results if r.get("ok") and "digest" in r}


def compare(got: dict, expected: dict) -> dict:
    """How two runs' digests (``digests``) agree: requests compared, equal, and the first few
    keys that differ (or that one run lacks)."""
    keys = sorted(set(got) | set(expected), key=str)
    differ = [k for k in keys if got.get(k) != expected.get(k)]
    return {"compared": len(keys), "equal": len(keys) - len(differ), "identical": not differ,
            "differ": differ[:10]}
