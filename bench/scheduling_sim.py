"""Scheduling simulator: replays a request trace against the real control-plane scheduler.

``Scheduler``, ``Policy`` and a real ``BlockManager`` run unchanged on a virtual clock; only
the model is replaced: a step takes ``base_ms + per_token_ms * tokens + per_ctx_ms * KV tokens
read`` (defaults, roughly an 8B model on one H100-class GPU: 4 ms, 0.06 ms/token, 40 ns per KV
token). After a step every sequence whose KV caught up with its tokens samples one token, as
the workers do; it finishes after its trace output length. Requests are added at their own
arrival time (the engine's ``submit`` runs while a step is in flight), so ``waiting_since``
and ``max_queue_delay`` count from the arrival. Per request: queue delay (arrival -> first
scheduled), TTFT (arrival -> end of the step that sampled its first token), E2E (-> finish).
Not modelled: (de)tokenization, network, the control plane's CPU time, sampling, stop
strings, prefix sharing, parallel samples, aborts, step-time noise. See docs/scheduling.md;
``bench.chunking_sim`` runs the same simulation for the prefill chunking options.

    python -m bench.scheduling_sim --out docs --seed 0      # tables on stdout, docs/scheduling.png
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import math
import os
import pathlib
import random

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.scheduling.chunking import Chunking
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.requests.request import Request, Sequence
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


def _f(default, help):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    duration: float = _f(300.0, "seconds of arrivals")
    calm_rate: float = _f(18.0, "requests/s in the calm phase (Poisson)")
    burst_rate: float = _f(60.0, "requests/s in a burst (Poisson)")
    calm_s: float = _f(20.0, "mean calm phase length, s (exponential)")
    burst_s: float = _f(5.0, "mean burst length, s (exponential)")
    prompt_mean: float = _f(200.0, "mean prompt tokens (lognormal before clipping)")
    output_mean: float = _f(180.0, "mean output tokens (lognormal before clipping)")
    sigma: float = _f(1.0, "lognormal shape of both lengths (long tail)")
    max_model_len: int = _f(4096, "context: prompt + output are clipped to it")
    interactive_frac: float = _f(0.2, "fraction of requests with priority 0 (the rest: 1)")
    max_tokens_cap: int = _f(0, "0: max_tokens = true output length (sjf knows lengths); "
                                "N: clients ask max_tokens=N and stop early")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    policy: str = _f("fifo", "fifo | priority | sjf")
    aging: float = _f(-1.0, "aging rate, rank units per waited second (<0: policy default)")
    max_queue_delay: float = _f(0.0, "queue-delay guarantee in s (0: none)")
    num_blocks: int = _f(4096, "KV pool, blocks")
    block_size: int = _f(16, "tokens per KV block")
    max_running: int = _f(128, "cap on running sequences")
    max_batched_tokens: int = _f(2048, "token budget per step")
    watermark: float = _f(0.01, "fraction of blocks admission leaves free")
    base_ms: float = _f(4.0, "step time: fixed cost per step, ms")
    per_token_ms: float = _f(0.06, "step time: per computed token, ms")
    per_ctx_ms: float = _f(0.00004, "step time: per KV token read by attention, ms")


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt_len: int
    output_len: int     # tokens generated before it stops
    max_tokens: int     # what the client asked for (>= output_len)
    priority: int


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma ** 2 / 2        # so the unclipped mean is ``mean``
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def make_trace(cfg: TraceConfig, seed: int = 0) -> list[TraceRequest]:
    """Bursty Poisson arrivals (the rate switches between a calm and a burst phase of
    exponential lengths) with lognormal ShareGPT-like lengths; deterministic per seed."""
    rng = random.Random(seed)
    t, burst, trace = 0.0, False, []
    phase_end = rng.expovariate(1 / cfg.calm_s)
    while True:
        gap = rng.expovariate(cfg.burst_rate if burst else cfg.calm_rate)
        if t + gap >= phase_end:                # memoryless: redraw from the switch
            t, burst = phase_end, not burst
            phase_end = t + rng.expovariate(1 / (cfg.burst_s if burst else cfg.calm_s))
            continue
        t += gap
        if t >= cfg.duration:
            return trace
        prompt = _lognormal(rng, cfg.prompt_mean, cfg.sigma, 1, cfg.max_model_len - 1)
        room = cfg.max_model_len - prompt
        output = _lognormal(rng, cfg.output_mean, cfg.sigma, 1, room)
        max_tokens = min(cfg.max_tokens_cap, room) if cfg.max_tokens_cap else output
        priority = 0 if rng.random() < cfg.interactive_frac else 1
        trace.append(TraceRequest(t, prompt, min(output, max_tokens), max_tokens, priority))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Record:
    req: TraceRequest
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    max_wait: float = 0.0       # longest single wait, including re-waits after preemption
    head_at: float | None = None    # first step it led the overdue queue (this wait)
    max_head_wait: float = 0.0      # longest time from leading the overdue queue to admission
    preemptions: int = 0

    queue_delay = property(lambda self: self.first_scheduled - self.req.arrival)
    ttft = property(lambda self: self.first_token - self.req.arrival)
    e2e = property(lambda self: self.finished - self.req.arrival)


SimResult = collections.namedtuple("SimResult", "records preemptions max_step_s end decode_steps_s")


def step_seconds(step: ScheduledStep, cfg: SimConfig) -> float:
    """Modelled duration; call before ``after_step`` (KV read = computed + scheduled tokens)."""
    ctx = sum(s.num_computed + n for s, n in step.scheduled())
    return (cfg.base_ms + cfg.per_token_ms * step.num_tokens + cfg.per_ctx_ms * ctx) / 1e3


def _sequence(i: int, r: TraceRequest) -> Sequence:
    req = Request(request_id=str(i), arrival=r.arrival)
    req.sequences.append(Sequence(
        request=req, seq_id=i + 1, index=0, prompt_token_ids=[1] * r.prompt_len,
        sampling=wpb.Sampling(), max_tokens=r.max_tokens,
        output=OutputText(None, []), priority=r.priority, arrival=r.arrival))
    return req.sequences[0]


def simulate(trace: list[TraceRequest], cfg: SimConfig, chunking: Chunking | None = None) -> SimResult:
    clock, delay = Clock(), cfg.max_queue_delay or None
    policy = Policy(cfg.policy, None if cfg.aging < 0 else cfg.aging, delay)
    sched = Scheduler(BlockManager(cfg.num_blocks, cfg.block_size, enable_prefix_cache=False),
                      cfg.max_running, cfg.max_batched_tokens, policy, cfg.watermark, clock=clock,
                      chunking=chunking)
    trace = sorted(trace, key=lambda r: r.arrival)
    records: dict[int, Record] = {}
    i = spins = 0
    max_step, decode_steps = 0.0, []   # the durations of steps that carried decodes
    while i < len(trace) or sched.has_work:
        if not sched.has_work and clock.now < trace[i].arrival:
            clock.now = trace[i].arrival        # idle: jump to the next arrival
        now = clock.now
        while i < len(trace) and trace[i].arrival <= now:
            clock.now = trace[i].arrival        # submitted at arrival, while a step runs
            seq = _sequence(i, trace[i])
            records[seq.seq_id] = Record(trace[i])
            sched.add([seq])
            i += 1
        clock.now = now
        if delay:   # who leads the overdue queue (the policy admits it first, by waiting_since)
            late = [s for s in sched.waiting if now - s.waiting_since >= delay]
            if late:
                head = records[min(late, key=lambda s: (s.waiting_since, s.seq_id)).seq_id]
                head.head_at = now if head.head_at is None else head.head_at
        step = sched.schedule()
        spins = spins + 1 if step.empty else 0
        if spins:           # the engine would wait for an event; should not happen here
            assert spins < 100_000, "the scheduler makes no progress with work queued"
            clock.now += 0.001
            continue
        for seq in (r.seq for r in step.new):
            rec = records[seq.seq_id]
            rec.max_wait = max(rec.max_wait, now - seq.waiting_since)
            if rec.head_at is not None:
                rec.max_head_wait, rec.head_at = max(rec.max_head_wait, now - rec.head_at), None
            if rec.first_scheduled is None:
                rec.first_scheduled = now
        dt = step_seconds(step, cfg)
        max_step, clock.now = max(max_step, dt), now + dt
        if any(n == 1 and s.output_token_ids for s, n in step.scheduled()):
            decode_steps.append(dt)
        sched.after_step(step)
        for seq, _ in step.scheduled():
            if seq.num_inflight:           # it sampled: its token arrives with the step's end
                seq.num_inflight -= 1
                seq.output_token_ids.append(7)
                rec = records[seq.seq_id]
                rec.first_token = clock.now if rec.first_token is None else rec.first_token
                if len(seq.output_token_ids) >= rec.req.output_len:
                    sched.finish(seq, pb.FINISH_REASON_LENGTH)
                    rec.finished, rec.preemptions = clock.now, seq.num_preemptions
    return SimResult(list(records.values()), sched.num_preemptions, max_step, clock.now, decode_steps)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted(xs)[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def summarize(res: SimResult) -> dict[str, float]:
    recs = res.records
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    ttft, e2e, qd = [r.ttft for r in recs], [r.e2e for r in recs], [r.queue_delay for r in recs]
    return {"mean_ttft": mean(ttft), "p99_ttft": pct(ttft, 99), "mean_e2e": mean(e2e),
            "p99_e2e": pct(e2e, 99), "p99_qd": pct(qd, 99), "max_qd": max(qd),
            "max_wait": max(r.max_wait for r in recs),
            "max_head_wait": max(r.max_head_wait for r in recs),
            "mean_ttft_p0": mean([r.ttft for r in recs if r.req.priority == 0]),
            "tok_s": sum(r.req.output_len for r in recs) / (res.end - min(r.req.arrival for r in recs)),
            "preemptions": res.preemptions, "max_preempt": max(r.preemptions for r in recs),
            "max_step": res.max_step_s}


COLUMNS = [("mean_ttft", "mean TTFT"), ("p99_ttft", "p99 TTFT"), ("mean_e2e", "mean E2E"),
           ("p99_e2e", "p99 E2E"), ("p99_qd", "p99 queue"), ("max_qd", "max queue"),
           ("mean_ttft_p0", "mean TTFT prio 0"), ("tok_s", "out tok/s"), ("preemptions", "preemptions")]
GUARANTEE = [("max_qd", "max queue"), ("max_wait", "max wait (any)"), ("over", "max wait - D"),
             ("max_head_wait", "max head wait"), ("max_step", "max step"), ("preemptions", "preemptions"),
             ("max_preempt", "max preemptions of one")]


def markdown_table(rows: dict[str, dict[str, float]], columns=COLUMNS) -> str:
    """Times in seconds; counts and token rates as integers."""
    lines = ["| policy | " + " | ".join(h for _, h in columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for name, s in rows.items():
        cells = ["-" if math.isnan(s[k]) else f"{s[k]:.3f}" if isinstance(s[k], float) and k != "tok_s"
                 else f"{s[k]:.0f}" for k, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_report(trace: list[TraceRequest], base: SimConfig, delay: float, sweep=(), jobs: int = 1):
    """fifo, priority, sjf (default aging), priority and sjf with ``max_queue_delay=delay``,
    and priority/sjf for every D of ``sweep``; returns ({name: SimResult}, {name: summary})."""
    variants = {p: (p, 0.0) for p in ("fifo", "priority", "sjf")}
    variants |= {f"{p} D={d:g}": (p, d) for p in ("priority", "sjf") for d in sorted({delay, *sweep})}
    cfgs = [dataclasses.replace(base, policy=p, max_queue_delay=d) for p, d in variants.values()]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        results = dict(zip(variants, pool.map(simulate, [trace] * len(cfgs), cfgs)))
    rows = {name: summarize(r) for name, r in results.items()}
    for name, (_, d) in variants.items():
        rows[name]["D"], rows[name]["over"] = d, rows[name]["max_wait"] - d if d else math.nan
    return results, rows


def _main_rows(delay: float) -> list[str]:
    return ["fifo", "priority", "sjf", f"priority D={delay:g}", f"sjf D={delay:g}"]


def plot(results: dict[str, SimResult], rows: dict[str, dict[str, float]], delay: float,
         path: pathlib.Path) -> None:
    import matplotlib  # a tool dependency only: imported here, never by the tests
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = _main_rows(delay)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name in main:
        xs = sorted(r.ttft for r in results[name].records)
        ax1.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=name, ls="--" if "D=" in name else "-")
    ax1.set(xscale="log", xlabel="TTFT (s, log scale)", ylabel="fraction of requests", title="TTFT CDF")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    pos = range(len(main))
    ax2.bar([p - 0.2 for p in pos], [rows[n]["p99_qd"] for n in main], 0.4, label="p99")
    ax2.bar([p + 0.2 for p in pos], [rows[n]["max_qd"] for n in main], 0.4, label="max")
    ax2.set_xticks(list(pos), main, rotation=15, fontsize=8)
    ax2.set(ylabel="seconds", title="queue delay (arrival -> first scheduled)")
    ax2.legend(fontsize=8)
    for pol in ("priority", "sjf"):
        pts = sorted((s["D"], s["max_wait"]) for n, s in rows.items() if n.startswith(pol + " D="))
        ax3.plot(*zip(*pts), "o-", label=f"{pol}: max wait")
        ax3.axhline(rows[pol]["max_wait"], ls=":", color=ax3.lines[-1].get_color(), label=f"{pol}: no guarantee")
    ax3.axhline(rows["fifo"]["max_wait"], ls=":", color="gray", label="fifo")
    top = max(s["D"] for s in rows.values())
    ax3.plot([0, top], [0, top], "k--", lw=0.8, label="wait = D")
    ax3.set(xlabel="max_queue_delay D (s)", ylabel="seconds", title="longest wait vs the guarantee D")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="folder to write scheduling.png to (no plot if unset)")
    parser.add_argument("--max-queue-delay", type=float, default=5.0, help="D of the guarantee rows, s")
    parser.add_argument("--sweep", default="1,2,3,8", help="more D values for priority and sjf")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="simulations in parallel")
    own = lambda cls: [f for f in dataclasses.fields(cls) if f.name not in ("policy", "max_queue_delay")]
    for f in own(TraceConfig) + own(SimConfig):     # every parameter is a flag
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f.metadata["help"] + " (default %(default)s)")
    args = parser.parse_args(argv)
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in own(cls)})
    trace, delay = make_trace(pick(TraceConfig), args.seed), args.max_queue_delay
    span, n = trace[-1].arrival - trace[0].arrival, len(trace)
    print(f"trace: {n} requests over {span:.0f} s ({n / span:.1f} req/s), mean prompt "
          f"{sum(r.prompt_len for r in trace) / n:.0f}, mean output {sum(r.output_len for r in trace) / n:.0f}, "
          f"max prompt+output {max(r.prompt_len + r.output_len for r in trace)}, "
          f"priority 0: {sum(r.priority == 0 for r in trace) / n:.0%}")
    sweep = [float(x) for x in args.sweep.split(",") if x]
    results, rows = run_report(trace, pick(SimConfig), delay, sweep, args.jobs)
    print(markdown_table({k: rows[k] for k in _main_rows(delay)}) + "\n")
    print(markdown_table(rows, GUARANTEE) + "\n")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(results, rows, delay, out / "scheduling.png")
        print(f"wrote {out / 'scheduling.png'}")


if __name__ == "__main__":
    main()
