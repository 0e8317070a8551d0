"""Multi-LoRA under load, simulated: the real control-plane scheduler and LoRA slot rules
(``headrace.controlplane.lora``) on ``bench.scheduling_sim``'s virtual clock and step-time model
(roughly Llama-3.1-8B on one H100-class GPU), W4's arrivals and lengths (Poisson, lognormal
~200 prompt / ~180 output tokens), each request's adapter drawn with Zipf popularity over
``--adapters`` adapters that are all in the host cache, on ``--max-loras`` device slots. A step
with adapter tokens costs ``--lora-ms`` more, and each slot load ``--load-ms`` (the 8B rank-16
copy, 1.5 ms on an H100; counted as if the step waited for it).

What it answers before a GPU run: does the slot rule (a sequence is admitted only once its
adapter holds a slot; a slot is taken from an adapter only when none of its sequences runs)
keep W4's SLO (TTFT p99 <= 200 ms, ITL p99 <= 50 ms) at >= 0.8x the rate the base model
holds (issue 53's 8B target), or do rare adapters wait for a slot that popular adapters keep
busy? Per rate: TTFT / ITL p99 with and without adapters, the longest wait for a slot, and
the highest rate meeting the SLO of each.

    python -m bench.lora_sim --rates 8,12,16,20,24,28 --adapters 100 --max-loras 16
"""

from __future__ import annotations

import argparse
import bisect
import json
import random

from bench.scheduling_sim import Clock, SimConfig, TraceConfig, _sequence, make_trace, pct, step_seconds
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.lora.registry import LoraAdapters
from headrace.controlplane.lora.slots import Adapter, Slots
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.v1 import inference_pb2 as pb

SLO_TTFT_S, SLO_ITL_S = 0.200, 0.050


def zipf_choices(n: int, adapters: int, s: float, seed: int) -> list[int]:
    """``n`` adapter indices, index i drawn with weight 1 / (i + 1)^s."""
    rng = random.Random(seed)
    cum, total = [], 0.0
    for i in range(adapters):
        total += 1 / (i + 1) ** s
        cum.append(total)
    return [bisect.bisect_left(cum, rng.random() * total) for _ in range(n)]


def simulate(rate: float, args, lora: bool) -> dict:
    trace = make_trace(TraceConfig(duration=args.duration, calm_rate=rate, burst_rate=rate,
                                   prompt_mean=200, output_mean=180, interactive_frac=0.0,
                                   max_model_len=4096), seed=args.seed)
    cfg = SimConfig(num_blocks=args.num_blocks, max_running=256, max_batched_tokens=8192)
    clock = Clock()
    sched = Scheduler(BlockManager(cfg.num_blocks, cfg.block_size, enable_prefix_cache=False),
                      cfg.max_running, cfg.max_batched_tokens, Policy("fifo"), cfg.watermark, clock=clock)
    adapters = []
    if lora:
        registry = LoraAdapters()
        registry.max_loras = args.max_loras
        registry.slots = Slots(args.max_loras, args.adapters)
        for i in range(args.adapters):
            adapter = Adapter(f"a{i}", "", i + 1)
            registry.slots.cached(adapter)
            registry.by_name[adapter.name] = adapter
            adapters.append(adapter)
        sched.lora = registry
    picks = zipf_choices(len(trace), args.adapters, args.zipf, args.seed + 1)
    first, last, gaps, waits, admitted = {}, {}, [], [], set()
    running, distinct = [], []   # per step: sequences running, adapters they use (of the drawn ones)
    i = 0
    while i < len(trace) or sched.has_work:
        if not sched.has_work and clock.now < trace[i].arrival:
            clock.now = trace[i].arrival
        now = clock.now
        while i < len(trace) and trace[i].arrival <= now:
            seq = _sequence(i, trace[i])
            if lora:
                seq.lora = adapters[picks[i]]
            sched.add([seq])
            i += 1
        loads_before = sched.lora.slots.num_loads if lora else 0
        step = sched.schedule()
        if step.empty:
            clock.now += 0.001
            continue
        for new in step.new:
            if new.seq.seq_id not in admitted:   # (arrival -> first admission: the queue and a slot)
                admitted.add(new.seq.seq_id)
                waits.append(now - trace[new.seq.seq_id - 1].arrival)
        running.append(len(sched.running))
        distinct.append(len({picks[s.seq_id - 1] for s in sched.running}))
        dt = step_seconds(step, cfg)
        if lora and any(s.lora is not None for s, _ in step.scheduled()):
            dt += args.lora_ms / 1e3 + (sched.lora.slots.num_loads - loads_before) * args.load_ms / 1e3
        clock.now = now + dt
        sched.after_step(step)
        for seq, _ in step.scheduled():
            if not seq.num_inflight:
                continue
            seq.num_inflight -= 1
            seq.output_token_ids.append(7)
            sid = seq.seq_id
            if sid in last:
                gaps.append(clock.now - last[sid])
            else:
                first[sid] = clock.now - trace[sid - 1].arrival
            last[sid] = clock.now
            if len(seq.output_token_ids) >= trace[sid - 1].output_len:
                sched.finish(seq, pb.FINISH_REASON_LENGTH)
    ttft = list(first.values())
    out = {"rate": rate, "lora": lora, "requests": len(trace), "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
           "itl_p99_ms": round(pct(gaps, 99) * 1e3, 1) if gaps else 0.0,
           "wait_max_ms": round(max(waits) * 1e3, 1),
           "running_mean": round(sum(running) / len(running), 1),
           "adapters_in_flight_mean": round(sum(distinct) / len(distinct), 1)}
    out["meets_slo"] = out["ttft_p99_ms"] <= SLO_TTFT_S * 1e3 and out["itl_p99_ms"] <= SLO_ITL_S * 1e3
    if lora:
        out["slot_loads"] = sched.lora.slots.num_loads
    return out


def highest(rows: list[dict]) -> float:
    """The highest rate of a run of rates, from the lowest, that meets the SLO (0: none)."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not row["meets_slo"]:
            break
        best = row["rate"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="8,12,16,20,24,28")
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals a rate")
    ap.add_argument("--num-blocks", type=int, default=20000, help="KV blocks of 16 tokens")
    ap.add_argument("--lora-ms", type=float, default=0.3, help="a step's added time with adapter tokens")
    ap.add_argument("--load-ms", type=float, default=1.5, help="one slot load")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = {False: [], True: []}
    for rate in (float(r) for r in args.rates.split(",")):
        for lora in (False, True):
            row = simulate(rate, args, lora)
            rows[lora].append(row)
            print(json.dumps(row), flush=True)
    base, with_lora = highest(rows[False]), highest(rows[True])
    print(json.dumps({"bench": "lora_sim", "base_rate": base, "lora_rate": with_lora,
                      "ratio": round(with_lora / base, 3) if base else None}))


if __name__ == "__main__":
    main()
