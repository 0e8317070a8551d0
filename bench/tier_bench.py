"""The host KV tier's in-process comparisons (issue 33): engines driving data plane workers in this
one process (``headrace.dataplane.inprocess``, no gRPC), W1's requests (``bench.serving_bench``),
each case's runs alternated so a drift of the machine hits both sides.

    python -m bench.tier_bench --model /tmp/qwen3 --cases idle,swap

``idle``: an idle tier costs nothing. W1 on a worker without a host tier and on one with
``--kv-offloading-size`` (16 GiB), both with ``--num-kv-blocks`` (18,432: W1 never evicts
nor preempts there, so the tier is configured and unused), ``--repeats`` times each,
alternated; the ratio of the medians is the target's (within 2%).

``swap``: ``--preemption-mode swap`` against recompute on a preemption-heavy run: W1 on the
worker with the tier, its engine given only ``--swap-blocks`` of its device blocks (the
control plane never hands out the others), so sequences are preempted over and over; each of
``--swap-modes`` is a preemption mode and a ``--kv-offloading-policy``: ``recompute/off`` is
recompute without a host tier (the swapped-out KV's alternative), ``swap/auto`` keeps a
victim's KV in the tier and copies it back, ``recompute/auto`` recomputes victims but finds
their evicted blocks in the tier's prefix cache. Reports tok/s, preemptions, blocks copied
each way and the copy time.

One JSON line per run, then one per case with the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time

from bench.inprocess_bench import consume, submitter
from bench.serving_bench import w1_requests
from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker, WorkerOptions


class Workers(InProcessWorkerGroup):
    """The in-process worker group, its KV pool as the control plane sees it cut to ``blocks``
    (None: all of it): block ids past that are never sent."""

    def __init__(self, worker: Worker, blocks: int | None = None):
        super().__init__(worker)
        self.blocks = blocks

    @property
    def num_kv_blocks(self) -> int:
        n = super().num_kv_blocks
        return n if self.blocks is None else min(n, self.blocks)


def workload(args, vocab_size: int) -> list[tuple[list[int], int, float]]:
    """W1's requests (the first ``--requests``; prompts and outputs cut to ``--tokens-cap``
    each, and ids folded into the vocabulary, for a small model's smoke run)."""
    cap = args.tokens_cap or 1 << 30
    return [([t % vocab_size for t in p[:cap]], min(n, cap), temp) for p, n, temp in w1_requests()[:args.requests]]


async def run_w1(workers: Workers, args, config: EngineConfig) -> dict:
    """W1 through a fresh engine on ``workers``: throughput, preemptions, host-tier copies."""
    engine = Engine(workers, config)
    await engine.start()
    submit = submitter(engine, ModelTokenizer(args.model))
    try:
        await consume(submit([1, 2, 3], 4, 0.6))   # warm-up
        requests = workload(args, engine.info.vocab_size)
        host = workers.worker.runner.host_kv
        if host is not None:
            host.drain()
        sched = engine.scheduler
        preempted, tier = sched.num_preemptions, sched.blocks.host
        moved = (tier.blocks_out, tier.blocks_in) if tier is not None else (0, 0)
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(consume(submit(*r)) for r in requests)))
        wall = time.perf_counter() - start
        copy_ms, out_bytes, in_bytes = host.drain() if host is not None else (0.0, 0, 0)
        return {"output_tok_per_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "output_tokens": tokens,
                "preemptions": sched.num_preemptions - preempted,
                "blocks_out": (tier.blocks_out - moved[0]) if tier is not None else 0,
                "blocks_in": (tier.blocks_in - moved[1]) if tier is not None else 0,
                "copy_s": round(copy_ms / 1e3, 3), "copy_gb_out": round(out_bytes / 1e9, 2),
                "copy_gb_in": round(in_bytes / 1e9, 2), "num_kv_blocks": workers.num_kv_blocks}
    finally:
        await engine.stop()


def _config(args, preemption_mode: str = "recompute") -> EngineConfig:
    return EngineConfig(max_running=256, max_batched_tokens=args.max_batched_tokens,
                        preemption_mode=preemption_mode)


def _worker(args, offload_gib: float) -> Worker:
    return Worker(WorkerOptions(model=args.model, device=args.device, max_num_seqs=256,
                                max_batched_tokens=args.max_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                                kv_offloading_size=offload_gib))


def _emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


async def idle(args, bare: Worker, tiered: Worker) -> None:
    runs = {"none": [], "idle tier": []}
    for r in range(args.repeats):
        for name, worker in (("none", bare), ("idle tier", tiered)):
            row = await run_w1(Workers(worker), args, _config(args))
            runs[name].append(_emit(dict(row, workload="w1-tier-idle", host_tier=name, repeat=r))["output_tok_per_s"])
    none, tier = statistics.median(runs["none"]), statistics.median(runs["idle tier"])
    _emit({"workload": "w1-tier-idle-summary", "none_tok_per_s": none, "idle_tier_tok_per_s": tier,
           "idle_over_none": round(tier / none, 4), "offload_gib": args.offload_gib})


async def swap(args, tiered: Worker) -> None:
    modes = [tuple(m.strip().split("/")) for m in args.swap_modes.split(",") if m.strip()]
    runs: dict[str, list[dict]] = {f"{m}/{p}": [] for m, p in modes}
    for r in range(args.swap_repeats):
        for mode, policy in modes:
            config = dataclasses.replace(_config(args, mode), kv_offloading_policy=policy)
            row = await run_w1(Workers(tiered, args.swap_blocks), args, config)
            runs[f"{mode}/{policy}"].append(_emit(dict(row, workload="w1-preemption", preemption_mode=mode,
                                                        kv_offloading_policy=policy, repeat=r)))
    med = {m: statistics.median(x["output_tok_per_s"] for x in rows) for m, rows in runs.items()}
    base = next(iter(med))
    _emit({"workload": "w1-preemption-summary", "tok_per_s": med, "over_first": {m: round(v / med[base], 4)
           for m, v in med.items()}, "preemptions": {m: rows[-1]["preemptions"] for m, rows in runs.items()},
           "swap_blocks": args.swap_blocks})


async def main_async(args) -> None:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in ("idle", "swap") for c in cases):
        raise SystemExit("--cases: a comma-separated list of idle, swap")
    tiered = _worker(args, args.offload_gib)
    if "idle" in cases:
        await idle(args, _worker(args, 0.0), tiered)
    if "swap" in cases:
        await swap(args, tiered)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="idle,swap", help="idle, swap (comma-separated)")
    ap.add_argument("--num-kv-blocks", type=int, default=18432,
                    help="each worker's device KV pool (W1 needs 17,422 blocks of 16 at most)")
    ap.add_argument("--offload-gib", type=float, default=16.0, help="the tiered worker's --kv-offloading-size")
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2, help="idle: W1 runs on each worker, alternated")
    ap.add_argument("--swap-blocks", type=int, default=4096,
                    help="swap: device blocks the control plane may use (a quarter of W1's need)")
    ap.add_argument("--swap-repeats", type=int, default=1, help="swap: runs of each mode, alternated")
    ap.add_argument("--swap-modes", default="recompute/off,swap/auto",
                    help="swap: PREEMPTION_MODE/KV_OFFLOADING_POLICY runs (recompute/off: no host "
                         "tier at all; recompute/auto: preempted blocks may come back through the "
                         "tier's prefix cache)")
    ap.add_argument("--requests", type=int, default=256, help="the first N of W1's requests (smoke runs)")
    ap.add_argument("--tokens-cap", type=int, default=0, help="cut prompts and outputs to this (smoke runs)")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
