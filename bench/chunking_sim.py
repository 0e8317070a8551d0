"""What the prefill chunking options cost and buy, on the real scheduler and a virtual clock
(``bench.scheduling_sim``'s simulation, no GPU): for each ``--max-prefill-tokens-with-decodes``
of ``--budgets``, a workload's output throughput, TTFT p50 / p99 and the time of the steps that
carry decodes (p99 and longest: what a streaming client sees as inter-token latency).

Workloads: ``w1`` (nano-vllm's 256 requests at once, prompts 100-1024, outputs 100-1024,
``--max-batched-tokens 16384``, a Qwen3-0.6B-on-H200 step model), ``w3`` (256 x 1000-token
prompts and outputs, 8192, a Llama-3.1-8B step model) and ``w4`` (Poisson arrivals at
``--rate``, lognormal ~200 in / ~180 out, 8192, the 0.6B step model). Step models: a fixed
cost, a cost per token computed and one per KV token read, fitted by hand to the measured W1
and W3 figures of docs/benchmarks.md (the simulated W1 and W3 land within ~7% of them).

    python -m bench.chunking_sim                       # every workload, budgets 2048..16384 and
    none python -m bench.chunking_sim --workloads w3 --budgets 1024,2048
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import random

from bench.scheduling_sim import SimConfig, TraceConfig, TraceRequest, make_trace, pct, simulate
from headrace.controlplane.scheduling.chunking import Chunking

UNBOUNDED = 1 << 30
QWEN3_06B_H200 = dict(base_ms=1.2, per_token_ms=0.0016, per_ctx_ms=0.000027)
LLAMA_8B_H200 = dict(base_ms=4.0, per_token_ms=0.02, per_ctx_ms=0.000031)


def closed_batch(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    """``n`` requests all arriving at once, lengths uniform in the given ranges (W1, W3)."""
    rng = random.Random(seed)
    return [TraceRequest(0.0, rng.randint(*prompt), out, out, 0)
            for out in (rng.randint(*output) for _ in range(n))]


def workload(name: str, rate: float, seed: int) -> tuple[list[TraceRequest], SimConfig]:
    engine = dict(num_blocks=40_000, max_running=256, watermark=0.01)
    if name == "w1":
        return (closed_batch(256, (100, 1024), (100, 1024), seed),
                SimConfig(max_batched_tokens=16384, **engine, **QWEN3_06B_H200))
    if name == "w3":
        return (closed_batch(256, (1000, 1000), (1000, 1000), seed),
                SimConfig(max_batched_tokens=8192, **engine, **LLAMA_8B_H200))
    trace = make_trace(TraceConfig(duration=20.0, calm_rate=rate, burst_rate=rate, sigma=1.0,
                                   max_model_len=2048, interactive_frac=0.0), seed)
    return trace, SimConfig(max_batched_tokens=8192, **engine, **QWEN3_06B_H200)


def measure(name: str, budget: int, rate: float, seed: int) -> dict:
    trace, cfg = workload(name, rate, seed)
    res = simulate(trace, cfg, Chunking(max_prefill_tokens_with_decodes=budget))
    ttft = [r.ttft for r in res.records]
    span = res.end - min(r.req.arrival for r in res.records)
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731
    return {"workload": name, "budget": "none" if budget == UNBOUNDED else budget,
            "out_tok_s": round(sum(r.req.output_len for r in res.records) / span),
            "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
            "decode_step_ms_p99": ms(pct(res.decode_steps_s, 99)),
            "decode_step_ms_max": ms(max(res.decode_steps_s))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="w1,w3,w4", help="comma-separated: w1, w3, w4")
    ap.add_argument("--budgets", default="2048,4096,8192,16384",
                    help="--max-prefill-tokens-with-decodes values (each beside no bound)")
    ap.add_argument("--rate", type=float, default=140.0, help="w4: requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    budgets = [UNBOUNDED] + [int(b) for b in args.budgets.split(",") if b]
    runs = [(w, b) for w in args.workloads.split(",") for b in budgets]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(measure, *zip(*runs), [args.rate] * len(runs), [args.seed] * len(runs)))
    base = {r["workload"]: r["out_tok_s"] for r in rows if r["budget"] == "none"}
    print("| workload | prefill tokens with decodes | out tok/s | vs none | TTFT p50 / p99 (ms) "
          "| decode step p99 / max (ms) |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['workload']} | {r['budget']} | {r['out_tok_s']} | "
              f"{r['out_tok_s'] / base[r['workload']]:.3f} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
              f"{r['decode_step_ms_p99']} / {r['decode_step_ms_max']} |")


if __name__ == "__main__":
    main()
