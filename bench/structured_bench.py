"""Structured outputs' cost through the gRPC planes: inter-token latency with a JSON-schema
constraint against the same requests unconstrained, at batch 1 and batch 64 (issue 34's
targets: <= 1.05x and <= 1.10x), interleaved off / on to cancel drift; the constrained
outputs checked (every token allowed by a fresh matcher; a bounded schema's outputs
validate); and W1 with no constrained request (the feature must cost nothing unused).

    python -m bench.structured_bench --model DIR [--address HOST:PORT] [--repeats 2]

The model needs a tokenizer that spells text (``bench.random_checkpoint --tokenizer
bytelevel``). Starts ``headrace serve`` unless --address is given; prints one JSON line per
measurement and a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import grpc

from bench.serving_bench import SERVE, throughput, w1_requests
from headrace.client import AsyncClient
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

# long enough never to finish in 256 tokens: ITL is measured over whole requests
LONG = {"type": "array", "minItems": 80, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                   "ok": {"type": "boolean"}}}}
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
           "properties": {"name": {"type": "string", "maxLength": 10},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


def w1_workload(args) -> list:
    """W1's requests (the first ``--w1-requests``; output lengths capped at ``--w1-max-tokens``)."""
    return [(p, min(m, args.w1_max_tokens), t) for p, m, t in w1_requests()[:args.w1_requests]]


def w1_args(args) -> argparse.Namespace:
    """What ``serving_bench.throughput`` reads of its own command line."""
    return argparse.Namespace(address=args.address, clients=args.clients, channels=4, api="grpc",
                              http_url=None, dataplane_metrics=args.dataplane_metrics)


async def one(stub, prompt: list[int], max_tokens: int, schema: dict | None, interval: int = 0) -> dict:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0),
                             stream_interval=interval)
    if schema is not None:
        req.structured.json_schema = json.dumps(schema)
    stamps, ids, text, finish = [], [], [], 0
    async for r in stub.Generate(req):
        stamps.append((time.perf_counter(), len(r.token_ids)))
        ids += r.token_ids
        text.append(r.text)
        finish = r.finish_reason or finish
    gaps = [(t1 - t0) / n for (t0, _), (t1, n) in zip(stamps, stamps[1:]) for _ in range(n)]
    return {"ids": ids, "text": "".join(text), "finish": finish, "gaps": gaps}


async def itl(stub, batch: int, schema: dict | None, seed: int, new_tokens: int = 256,
              interval: int = 0) -> dict:
    """Mean ITL per request (its decode time per token: the messages' gaps, each spread over
    its tokens), and the gaps' p50 / p99 (per message: with ``interval`` > 1, chunk means)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(300, 10000) for _ in range(128)] for _ in range(batch)]
    outs = await asyncio.gather(*(one(stub, p, new_tokens, schema, interval) for p in prompts))
    gaps = sorted(g for o in outs for g in o["gaps"])
    per_request = [statistics.mean(o["gaps"]) for o in outs if o["gaps"]]
    return {"itl_ms_mean": statistics.mean(per_request) * 1e3, "itl_ms_p50": gaps[len(gaps) // 2] * 1e3,
            "itl_ms_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3, "outs": outs}


@functools.lru_cache(maxsize=1)
def long_grammar(model: str, vocab: int, eos: tuple[int, ...]):
    from headrace.controlplane.structured import backends
    from headrace.controlplane.structured.spec import Constraint

    return backends.load(backends.resolve("auto"), model, vocab, list(eos)).compile(
        Constraint("json", json.dumps(LONG)))


def check_outputs(model: str, vocab: int, eos: list[int], outs: list[dict]) -> int:
    """Every constrained output's tokens are allowed, in order, by a fresh matcher of LONG;
    returns how many tokens were checked."""
    compiled = long_grammar(model, vocab, tuple(eos))
    checked = 0
    for o in outs:
        m = compiled.matcher()
        for t in o["ids"]:
            assert m.accept(t), f"token {t} breaks the grammar after {checked} tokens: {o['text'][:200]}"
            checked += 1
    return checked


async def main_async(args) -> list[dict]:
    await AsyncClient(args.address).wait_ready(900)
    rows = []
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        await one(stub, [400, 401, 402], 8, None)      # warm-up, then a constrained one (the
        await one(stub, [400, 401, 402], 8, LONG)      # grammar is compiled and cached)
        bounded = await asyncio.gather(*(one(stub, [500 + i] * 16, 120, BOUNDED) for i in range(8)))
        import jsonschema
        valid = 0
        for o in bounded:
            if o["finish"] == pb.FINISH_REASON_STOP:
                jsonschema.validate(json.loads(o["text"]), BOUNDED)
                valid += 1
        rows.append({"measure": "bounded schema outputs that finished and validate", "value": f"{valid}/8"})
        for batch in (int(b) for b in args.batches.split(",")):
            runs = {"off": [], "on": []}
            checked = 0
            for r in range(args.repeats):
                for mode in ("off", "on"):
                    res = await itl(stub, batch, LONG if mode == "on" else None, r, args.new_tokens,
                                    args.stream_interval if batch > 1 else 0)
                    if mode == "on":
                        checked += check_outputs(args.model, info.vocab_size, list(info.eos_token_ids), res["outs"])
                    res.pop("outs")
                    runs[mode].append(res)
                    print(json.dumps({"batch": batch, "mode": mode, "run": r, **res}), flush=True)
            off = statistics.median(x["itl_ms_mean"] for x in runs["off"])
            on = statistics.median(x["itl_ms_mean"] for x in runs["on"])
            target = 1.05 if batch == 1 else 1.10
            rows.append({"measure": f"ITL batch {batch}: unconstrained / JSON schema (ms)",
                         "value": f"{off:.3f} / {on:.3f} = {on / off:.3f}x (target <= {target}x; "
                                  f"{checked} constrained tokens checked)"})
        if args.w1_requests:   # last: it must not disturb the ITL comparison
            w1 = await throughput(stub, w1_workload(args), w1_args(args))
            print(json.dumps({"workload": "w1", **w1}), flush=True)
            rows.append({"measure": "W1, no constrained request (tok/s)", "value": f"{w1['output_tok_per_s']:.0f}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--address", default=None, help="a running server (default: start one)")
    ap.add_argument("--port", type=int, default=50171)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--w1-requests", type=int, default=256, help="W1's requests (0: skip W1)")
    ap.add_argument("--w1-max-tokens", type=int, default=1024, help="cap on W1's output lengths")
    ap.add_argument("--clients", type=int, default=8, help="W1: client processes")
    ap.add_argument("--dataplane-metrics", default="http://127.0.0.1:9401/metrics",
                    help="the data plane's /metrics (W1's device busy / idle time)")
    ap.add_argument("--new-tokens", type=int, default=256, help="ITL: tokens per request")
    ap.add_argument("--batches", default="1,64", help="batch sizes of the ITL comparison")
    ap.add_argument("--stream-interval", type=int, default=16,
                    help="tokens per message at batches > 1: one asyncio client reading every token of "
                         "64 streams is itself the limit (client_pool's docstring); mean ITL is "
                         "unchanged by it (0: the server's default, one message a token)")
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 16384")
    args = ap.parse_args()
    server = None
    if args.address is None:
        args.address = f"127.0.0.1:{args.port}"
        server = subprocess.Popen([sys.executable, *SERVE, "--model", args.model, "--host", "127.0.0.1",
                                   "--port", str(args.port), "--http-port", "0", *args.serve_args.split()],
                                  env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"), start_new_session=True)
    try:
        rows = asyncio.run(main_async(args))
        print("\n| measurement | figure |\n| --- | --- |")
        for row in rows:
            print(f"| {row['measure']} | {row['value']} |")
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
