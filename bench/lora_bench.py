"""Multi-LoRA serving's targets (issue 53), each beside a same-run baseline of the base model:

* ``load``: a rank-16 adapter of the model copied from the host cache into a device slot
  (the transfer itself, CUDA-event timed, and ``LoraSlots.load`` until its event is done; target
  <= 5 ms for Llama-3.1-8B) and its read from disk (``LoadAdapter``'s work), on a worker here;
* ``w1``: W1 through gRPC on ``serve`` without ``--enable-lora``, then on ``serve`` with it and
  ``--adapters`` adapters: W1 on the base model, then W1 with the adapters dealt round robin
  over its 256 requests (target: >= 0.85x the server without LoRA; moonshot 0.95x);
* ``w2``: W2 (batch 1, 256 tokens after a 128-token prompt) on the LoRA server, base model and
  adapter alternating, and on the server without LoRA (target: adapter ITL <= 1.10x);
* ``cold``: the TTFT of a request whose adapter is in no host cache (read from disk at run
  time) beside a warm adapter's, each on a fresh prompt (no prefix-cache hit), against the
  read's own time as the server measured it (``headrace:lora_adapter_read_seconds``) plus the
  slot copy (``load``'s, when run) (target: delayed by no more than that load);
* ``w4``: W4-like Poisson load (``bench.w4_bench``'s lengths) over ``--adapters`` adapters with
  Zipf popularity (``--zipf``) on ``--max-loras`` slots, the highest rate meeting the SLO (TTFT
  p99 <= 200 ms, ITL p99 <= 50 ms) against the base model's on the server without LoRA
  (target >= 0.8x).

    python -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3 --device cuda
    python -m bench.lora_bench --model /tmp/qwen3 --cases load,w2,w1,cold
    python -m bench.lora_bench --model /tmp/llama8b --cases load,w4 --adapters 100 --max-loras 16 \\
        --serve-args "--device cuda --max-running 256 --max-batched-tokens 8192 --max-model-len 4096"

Adapters are random (``bench.lora_adapters``, rank ``--rank`` on all 7 projections), written
once under ``--adapter-dir``. Prints one JSON line per case and a table of the targets last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import grpc

from bench import client_pool, first_token, lora_adapters, serving_bench, w4_bench
from bench.ready import wait_ready
from headrace.common.stage_times import ENV as STAGES_ENV

ADMIN = "lora-bench"


def serve(args, lora: bool, extra: list[str] = (), stages: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-P", "-m", "headrace.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--http-port", "0", *args.serve_args.split(), *extra]
    if lora:
        cmd += ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
                "--max-cpu-loras", str(args.max_cpu_loras or args.adapters), "--lora-modules",
                *(f"a{i}={p}" for i, p in enumerate(args.paths))]
    env = dict(os.environ, HEADRACE_LOG_LEVEL=os.environ.get("LORA_BENCH_LOG_LEVEL", "WARNING"), HEADRACE_ADMIN_TOKEN=ADMIN)
    if stages:
        env[STAGES_ENV] = stages
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    wait_ready(f"127.0.0.1:{args.port}", server)
    if lora:   # the adapters read at start (up to the host caches' size) before measuring
        wait_cached(f"127.0.0.1:{args.port}", min(len(args.paths), args.max_cpu_loras or args.adapters))
    return server


def wait_cached(address: str, count: int, timeout: float = 600) -> None:
    from headrace.v1 import admin_pb2 as apb
    from headrace.v1 import admin_pb2_grpc as apb_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = apb_grpc.AdminStub(channel)
        while time.monotonic() < deadline:
            listed = stub.ListLoraAdapters(apb.ListLoraAdaptersRequest(),
                                           metadata=[("authorization", f"Bearer {ADMIN}")])
            errors = [s.adapter.error for s in listed.adapters if s.adapter.error]
            if errors:
                raise SystemExit(f"an adapter cannot be served: {errors[0]}")
            if sum(s.cached for s in listed.adapters) >= count:
                return
            time.sleep(0.5)


def w1(address: str, models: list[str], args) -> dict:
    reqs = serving_bench.w1_requests()[:args.num_seqs or None]
    items = [(0.0, p, m, temp, 0, models[i % len(models)]) for i, (p, m, temp) in enumerate(reqs)]
    client_pool.run(address, items[:8], 1, 1)   # warm-up: every adapter read and in a slot
    results, usage, t0 = client_pool.run(address, items, args.clients, 4)
    ok = [r for r in results if r["ok"]]
    wall = max((r["end"] for r in ok), default=t0) - t0
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(items), "failed": len(items) - len(ok), "output_tok_per_s":
            round(tokens / wall, 1) if wall > 0 else 0, "first_error":
            next((r["error"] for r in results if not r["ok"]), None), **usage}


async def _itl(stub, model: str, prompt: list[int], tokens: int, request_id: str = "",
               stages=None) -> tuple[float, list[float]]:
    from headrace.v1 import inference_pb2 as pb

    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0), model=model,
                             request_id=request_id)
    start, stamps = time.perf_counter(), []
    if stages is not None:
        stages.sent(request_id)
    async for resp in stub.Generate(req, timeout=600):
        if stages is not None and not stamps:
            stages.first(request_id)
        stamps.append((time.perf_counter(), len(resp.token_ids)))
    itls = [(t1 - t0) / n for (t0, _), (t1, n) in zip(stamps, stamps[1:]) for _ in range(n)]
    return stamps[0][0] - start, itls


def w2(address: str, models: list[str], repeats: int) -> dict:
    """Batch-1 TTFT / ITL per model, the models alternating."""
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    async def run():
        rng = random.Random(0)
        out = {m: ([], []) for m in models}
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for m in models:   # warm-up
                await _itl(stub, m, [1, 2, 3], 8)
            for _ in range(repeats):
                prompt = [rng.randint(10, 2000) for _ in range(128)]   # (any vocabulary)
                for m in models:
                    ttft, itls = await _itl(stub, m, prompt, 256)
                    out[m][0].append(ttft)
                    out[m][1].extend(itls)
        q = w4_bench.quantile
        return {m or "base": {"ttft_ms_p50": round(q(t, .5) * 1e3, 2), "itl_ms_p50": round(q(i, .5) * 1e3, 3),
                              "itl_ms_p99": round(q(i, .99) * 1e3, 3)} for m, (t, i) in out.items()}

    return asyncio.run(run())


def load(args) -> dict:
    """The host -> slot copy and the disk read of one adapter, on a worker in this process."""
    import torch

    from headrace.dataplane.lora import adapter as lora_adapter
    from headrace.dataplane.worker import Worker, WorkerOptions
    from headrace.worker.v1 import worker_pb2 as wpb

    worker = Worker(WorkerOptions(model=args.model, device="cuda", enable_lora=True, max_loras=2,
                                  max_lora_rank=args.rank, max_cpu_loras=2, num_kv_blocks=64,
                                  enforce_eager=True, max_batched_tokens=256, max_num_seqs=8))
    slots = worker.lora.slots
    reads = []
    for i in range(3):   # a read from disk and its packing (the page cache warm after the first)
        answer = worker.load_adapter(wpb.LoadAdapterRequest(adapter_id=i + 1, path=args.paths[0]))
        reads.append(answer.seconds)
    flat = slots.host[3]
    copies, loads = [], []
    for i in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(slots.stream):
            start.record()
            slots.memory[i % 2].copy_(flat, non_blocking=True)
            end.record()
        end.synchronize()
        copies.append(start.elapsed_time(end))
        t0 = time.perf_counter()
        slots.load(i % 2, 3)
        slots._pending[i % 2].synchronize()
        loads.append((time.perf_counter() - t0) * 1e3)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    shard = lora_adapter.load(args.paths[0], worker.cfg, None, args.rank, worker.dtype)
    return {"slot_bytes": slots.slot_bytes, "adapter_bytes": shard.num_bytes,
            "copy_ms_p50": round(med(copies), 3), "copy_gb_per_s": round(slots.slot_bytes / med(copies) / 1e6, 1),
            "load_ms_p50": round(med(loads), 3), "disk_read_s_first": round(reads[0], 3),
            "disk_read_s_warm": round(min(reads[1:]), 3)}


def _read_seconds(url: str) -> float:
    """The server's ``lora_adapter_read_seconds`` counter (its reads into the host caches)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("headrace:lora_adapter_read_seconds_total "):
                return float(line.split()[1])
    raise RuntimeError(f"{url} has no headrace:lora_adapter_read_seconds_total")


def cold(address: str, args) -> dict:
    """TTFT of requests whose adapters are read from disk then, beside warm ones: each
    prompt is new (no prefix-cache hit on either side), and each cold request's delay is
    compared with its adapter's read as the server timed it (the read's RPC to the workers)."""
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(1)

    def fresh():
        return [rng.randint(10, 2000) for _ in range(128)]   # (any vocabulary here)

    stages = first_token.ClientStamps(args.stages) if args.stages else None

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            warm = []
            for i in range(5):
                warm.append((await _itl(stub, "a0", fresh(), 4, f"warm-{i}", stages))[0])
            colds = []
            for name in [f"a{i}" for i in range(2, len(args.paths))][:4]:   # a0, a1: read at start
                before = _read_seconds(args.metrics)
                ttft = (await _itl(stub, name, fresh(), 4, f"cold-{name}", stages))[0]
                colds.append((ttft, _read_seconds(args.metrics) - before))
            return warm, colds

    warm, colds = asyncio.run(run())
    base = sorted(warm)[len(warm) // 2]
    over = [(t - base) - r for t, r in colds]
    out = {"warm_ttft_ms_p50": round(base * 1e3, 2), "cold_ttft_ms": [round(t * 1e3, 2) for t, _ in colds],
           "read_ms": [round(r * 1e3, 2) for _, r in colds],
           "cold_delay_ms": [round((t - base) * 1e3, 2) for t, _ in colds],
           "delay_over_read_ms_max": round(max(over) * 1e3, 2)}
    if args.stages:   # where the cold requests' extra time goes, stage by stage
        cold_ids = [f"cold-a{i}" for i in range(2, len(args.paths))][:4]
        out["stages_warm"] = first_token.decompose(args.stages, [f"warm-{i}" for i in range(5)])
        out["stages_cold"] = first_token.decompose(args.stages, cold_ids)
        out["cold_reads"] = lora_reads(args.stages, cold_ids)
    return out


def lora_reads(directory: str, request_ids: list[str]) -> list[dict]:
    """Per cold request (``cold-<adapter>``): the core's admission stage split around its
    adapter's read (``headrace.controlplane.lora.registry`` stamps ``lora:<name>`` read_start /
    read_done): arrival -> read start, the read, read done -> the step carrying its prompt
    scheduled, in ms."""
    from headrace.common.stage_times import read

    at: dict[tuple[str, str], float] = {}
    scheduled = []
    for t, key, stage, _ in read(directory):
        at.setdefault((key, stage), t)
        if key.startswith("step:") and stage == "scheduled":
            scheduled.append(t)
    rows = []
    for rid in request_ids:
        name = rid.split("-", 1)[1]
        got, start, done = at.get((rid, "core_received")), at.get((f"lora:{name}", "read_start")), \
            at.get((f"lora:{name}", "read_done"))
        step = next((t for t in sorted(scheduled) if done is not None and t >= done), None)
        if None in (got, start, done, step):
            continue
        rows.append({"request": rid, "to_read_ms": round((start - got) * 1e3, 3),
                     "read_ms": round((done - start) * 1e3, 3),
                     "read_to_step_ms": round((step - done) * 1e3, 3)})
    return rows


def w4(address: str, models: list[str] | None, args) -> dict:
    weights = [1 / (i + 1) ** args.zipf for i in range(len(models or [""]))]
    rng = random.Random(args.seed)
    rows = []

    def run_rate(rate):
        items = w4_bench.workload(rate, args.duration, args.seed, 200, 180)
        if models:
            items = [(o, p, m, rng.choices(models, weights)[0]) for o, p, m in items]
        return w4_bench.run_rate(address, rate, args, items)

    run_rate(2.0)
    rows = [run_rate(r) for r in args.rates]
    for _ in range(args.search):
        rate = w4_bench.next_rate(rows, resolution=args.resolution)
        if rate is None:
            break
        rows.append(run_rate(rate))
    best = max((r["rate"] for r in rows if r["meets_slo"]), default=None)
    return {"max_rate_at_slo": best, "rates": sorted(rows, key=lambda r: r["rate"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cases", default="load,w2,w1,cold")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=0, help="0: every adapter (cold: 2)")
    ap.add_argument("--adapter-dir", default=None, help="default MODEL-loras")
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 16384")
    ap.add_argument("--port", type=int, default=50171)
    ap.add_argument("--num-seqs", type=int, default=0, help="w1: the first N requests (0: all 256)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4, help="w2: prompts, each for base and adapter")
    ap.add_argument("--rates", default="4,8,16", help="w4: request rates (req/s)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--search", type=int, default=3)
    ap.add_argument("--resolution", type=float, default=1.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics", default="http://127.0.0.1:9400/metrics",
                    help="cold: the server's Prometheus endpoint (its adapter reads' time)")
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--stages", default=None, help="cold: a directory for the server's first-token "
                    "stamps (HEADRACE_STAGE_TIMES): the warm and cold requests' stages side by side")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    cases = args.cases.split(",")
    args.paths = lora_adapters.write_adapters(args.model, args.adapter_dir or args.model.rstrip("/") + "-loras",
                                              max(args.adapters, 6 if "cold" in cases else 1), args.rank)
    address, names = f"127.0.0.1:{args.port}", [f"a{i}" for i in range(args.adapters)]
    results = {}

    def emit(case, row):
        results[case] = row
        print(json.dumps({"bench": "lora", "case": case, **row}), flush=True)

    if "load" in cases:
        emit("load", load(args))
    if {"w1", "w2", "w4"} & set(cases):   # the server without LoRA: the baselines
        server = serve(args, lora=False)
        try:
            if "w1" in cases:
                emit("w1_no_lora", w1(address, [""], args))
            if "w2" in cases:
                emit("w2_no_lora", w2(address, [""], args.repeats))
            if "w4" in cases:
                emit("w4_no_lora", w4(address, None, args))
        finally:
            w4_bench.stop_server(server)
        server = serve(args, lora=True)
        try:
            if "w1" in cases:
                emit("w1_lora_base", w1(address, [""], args))
                emit("w1_lora_adapters", w1(address, names, args))
            if "w2" in cases:
                emit("w2_lora", w2(address, ["", "a0"], args.repeats))
            if "w4" in cases:
                emit("w4_lora", w4(address, names, args))
        finally:
            w4_bench.stop_server(server)
    if "cold" in cases:
        keep = args.max_cpu_loras
        args.max_cpu_loras, args.max_loras = 2, min(args.max_loras, 2)
        server = serve(args, lora=True, stages=args.stages)
        try:
            emit("cold", cold(address, args))
        finally:
            w4_bench.stop_server(server)
            args.max_cpu_loras = keep
    print(table(results))


def table(r: dict) -> str:
    rows = ["| target | measured | met |", "| --- | --- | --- |"]

    def add(name, value, ok):
        rows.append(f"| {name} | {value} | {'yes' if ok else 'no'} |")

    if "load" in r:
        add("host -> slot copy <= 5 ms", f"{r['load']['copy_ms_p50']} ms ({r['load']['load_ms_p50']} ms "
            f"through LoraSlots.load)", r["load"]["copy_ms_p50"] <= 5)
    if "w1_lora_adapters" in r and "w1_no_lora" in r:
        x = r["w1_lora_adapters"]["output_tok_per_s"] / max(r["w1_no_lora"]["output_tok_per_s"], 1e-9)
        add("W1, 8 adapters >= 0.85x no LoRA", f"{x:.3f}x", x >= 0.85)
    if "w2_lora" in r and "w2_no_lora" in r:
        x = r["w2_lora"]["a0"]["itl_ms_p50"] / max(r["w2_lora"]["base"]["itl_ms_p50"], 1e-9)
        add("W2 ITL adapter <= 1.10x base", f"{x:.3f}x (base vs no LoRA: "
            f"{r['w2_lora']['base']['itl_ms_p50'] / max(r['w2_no_lora']['base']['itl_ms_p50'], 1e-9):.3f}x)", x <= 1.10)
    if "w4_lora" in r and "w4_no_lora" in r:
        a, b = r["w4_lora"]["max_rate_at_slo"], r["w4_no_lora"]["max_rate_at_slo"]
        add("W4 rate at SLO >= 0.8x base", f"{a} vs {b} req/s", bool(a and b and a >= 0.8 * b))
    if "cold" in r:
        copy = r["load"]["load_ms_p50"] if "load" in r else 0.0
        add("cold adapter delayed <= its load (read + slot copy)", f"delay {r['cold']['cold_delay_ms']} ms "
            f"against reads {r['cold']['read_ms']} ms + copy {copy} ms",
            r["cold"]["delay_over_read_ms_max"] <= copy)
    return "\n".join(rows)


if __name__ == "__main__":
    main()
