"""Placement at fleet scale, simulated: 100-1,000 replicas, each the real control-plane
``Scheduler`` and ``BlockManager`` (prefix cache on) on one virtual clock, with requests placed
by the real ``headrace.controlplane.frontend.placement`` rule from each replica's published cache
(``cache_summary.CacheView``, fed by its block manager's ``CacheEvents`` after every step) and
load: round robin, least load and prefix-aware placement on a multi-tenant shared-prefix
workload. Reports the prefix-cache hit rate, TTFT p50/p99, TPOT, goodput (requests meeting the
SLO per second) and how unevenly the replicas were loaded. docs/scaling.md shows the figure.

Workload: ``tenants_per_replica`` x replicas tenants, each with its own system prompt
(lognormal, mean ``prefix_mean`` tokens), Zipf-popular (``zipf``); a request is its tenant's
prompt plus its own question (``suffix_mean``) and answer (``output_mean``); Poisson arrivals
at ``rate_per_replica`` x replicas per second. Step time: ``base_ms + per_token_ms x tokens +
per_ctx_ms x KV tokens read``, plus ``mixed_ms`` when the step prefills (eager, not a CUDA
graph): Qwen3-0.6B on the H200 as measured (docs/benchmarks.md, REFERENCE §8: a graph decode
step ~1.3-1.9 ms, prefill ~2.2 us a token at 8k-token steps, decode attention ~27 ns a cached
token, ~9 ms of host time in an eager mixed step). The KV pool per replica (``num_blocks``) is
a share of a GPU: far fewer tokens than every tenant's prompt, so where a tenant's requests go
decides what is cached. Not modelled: the network, the front ends' own time, the ~20 ms
publication delay of cache changes (the placing front end expects its own placements at once).

    python -m bench.placement_sim --replicas 100:6:2,1000:1.2:0.6 --out docs   # docs/scaling.png
    (N[:DURATION[:WARMUP]]: a fleet size, with its own seconds of arrivals and of warm-up)
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import dataclasses
import heapq
import json
import pathlib
import random

from bench.scheduling_sim import Clock, _f, _lognormal, pct, step_seconds
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.kv.cache_summary import CacheEvents, CacheView, prompt_hashes
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.frontend.placement import Placement, load_score
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.requests.request import Request, Sequence
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

POLICIES = ("round-robin", "least-load", "prefix")


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    replicas: int = _f(100, "replicas (data-parallel engine cores)")
    duration: float = _f(20.0, "seconds of arrivals")
    warmup: float = _f(0.0, "seconds of arrivals left out of the figures (caches filling)")
    rate_per_replica: float = _f(4.0, "requests/s per replica (Poisson)")
    tenants_per_replica: float = _f(4.0, "tenants (system prompts) per replica")
    zipf: float = _f(1.0, "tenant popularity: Zipf exponent")
    prefix_mean: float = _f(2000.0, "mean system prompt tokens (lognormal)")
    suffix_mean: float = _f(150.0, "mean question tokens (lognormal)")
    output_mean: float = _f(150.0, "mean answer tokens (lognormal)")
    num_blocks: int = _f(2048, "KV blocks per replica (16 tokens each: 32k tokens)")
    block_size: int = _f(16, "tokens per block")
    max_running: int = _f(128, "sequences per step")
    max_batched_tokens: int = _f(8192, "tokens per step")
    base_ms: float = _f(1.5, "step: fixed (a CUDA-graph decode step), ms")
    per_token_ms: float = _f(0.0022, "step: per computed token, ms")
    per_ctx_ms: float = _f(0.000027, "step: per KV token read, ms")
    mixed_ms: float = _f(8.0, "step: host time of an eager step that prefills, ms")
    slo_ttft: float = _f(1.0, "SLO: time to first token, s")
    slo_tpot: float = _f(0.05, "SLO: mean time per output token, s")
    balance_abs: int = _f(32, "placement: --data-parallel-balance-threshold")
    balance_rel: float = _f(1.5, "placement: --data-parallel-balance-ratio")


@dataclasses.dataclass
class Rec:
    arrival: float
    prompt: int
    output: int
    cached: int = 0
    first: float | None = None
    done: float | None = None


class Replica:
    """One engine core: scheduler, block manager and the front end's view of its cache."""

    def __init__(self, cfg: FleetConfig, clock: Clock, holders: dict):
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        self.events, self.view, self.holders = CacheEvents(), CacheView(clock=clock), holders
        self.blocks.watch(self.events)
        self.events.take()
        self.sched = Scheduler(self.blocks, cfg.max_running, cfg.max_batched_tokens, Policy("fifo"),
                               clock=clock, fair_share=False)
        self.stepping = False
        self.ready = True

    @property
    def load(self) -> int:
        return load_score(len(self.sched.running), len(self.sched.waiting))

    def match(self, hashes) -> int:
        return self.view.match(hashes)

    def publish(self, me: int) -> None:
        """Its cache changes reach the placing front end (and the fleet's first-block index)."""
        _, stored, evicted = self.events.take()
        self.view.apply(False, stored, evicted)
        for h in stored:
            self.holders.setdefault(h, set()).add(me)


def make_requests(cfg: FleetConfig, seed: int):
    """(arrival, tenant, prompt length, output length), and the tenants' prompt lengths."""
    rng = random.Random(seed)
    tenants = max(1, round(cfg.tenants_per_replica * cfg.replicas))
    weights = [1 / (k + 1) ** cfg.zipf for k in range(tenants)]
    cum = [sum(weights[:1])]
    for w in weights[1:]:
        cum.append(cum[-1] + w)
    prefixes = [_lognormal(rng, cfg.prefix_mean, 0.5, 64, 8000) for _ in range(tenants)]
    t, out = 0.0, []
    while True:
        t += rng.expovariate(cfg.rate_per_replica * cfg.replicas)
        if t >= cfg.duration:
            return out, prefixes
        tenant = bisect.bisect_left(cum, rng.random() * cum[-1])
        out.append((t, tenant, _lognormal(rng, cfg.suffix_mean, 0.8, 1, 2000),
                    _lognormal(rng, cfg.output_mean, 0.8, 1, 2000)))


def _tokens(tenant: int, n_prefix: int, i: int, n_suffix: int) -> list[int]:
    """A tenant's system prompt (its own token ids) and the request's own question."""
    return list(range(tenant * 9000, tenant * 9000 + n_prefix)) + list(range((1 << 30) + i * 2001, (1 << 30) + i * 2001 + n_suffix))


def simulate(cfg: FleetConfig, policy: str, seed: int = 0) -> dict:
    clock, holders = Clock(), {}
    fleet = [Replica(cfg, clock, holders) for _ in range(cfg.replicas)]
    placement = Placement(policy, cfg.balance_abs, cfg.balance_rel)
    requests, prefixes = make_requests(cfg, seed)
    recs, steps, placed, reasons = {}, [], [0] * cfg.replicas, {}
    i = 0

    def start(r: int) -> None:
        rep = fleet[r]
        step = rep.sched.schedule()
        if step.empty:
            rep.stepping = False
            return
        prefills = step.new or any(n > 1 for n in step.running.num_tokens)
        dt = step_seconds(step, cfg) + (cfg.mixed_ms / 1e3 if prefills else 0.0)
        rep.sched.after_step(step)
        rep.stepping = True
        heapq.heappush(steps, (clock.now + dt, r, step))

    while i < len(requests) or steps:
        if i < len(requests) and (not steps or requests[i][0] <= steps[0][0]):
            arrival, tenant, n_suffix, n_out = requests[i]
            clock.now = arrival
            ids = _tokens(tenant, prefixes[tenant], i, n_suffix)
            hashes = prompt_hashes(ids, cfg.block_size) if policy == "prefix" else []
            if policy == "round-robin":
                cand = list(range(cfg.replicas))
            else:   # the holders of the prompt's first block, and the least loaded replica
                least = min(range(cfg.replicas), key=lambda r: fleet[r].load)
                cand = sorted(holders.get(hashes[0], set()) | {least}) if hashes else [least]
            choice = placement.choose([fleet[r] for r in cand], hashes)
            r = cand[choice.index]
            reasons[choice.reason] = reasons.get(choice.reason, 0) + 1
            if hashes:
                fleet[r].view.expect(hashes)
                holders.setdefault(hashes[0], set()).add(r)
            req = Request(request_id=str(i), arrival=arrival)
            seq = Sequence(request=req, seq_id=i + 1, index=0, prompt_token_ids=ids,
                           sampling=wpb.Sampling(), max_tokens=n_out, output=OutputText(None, []),
                           arrival=arrival)
            req.sequences.append(seq)
            recs[seq.seq_id] = Rec(arrival, len(ids), n_out)
            fleet[r].sched.add([seq])
            placed[r] += 1
            i += 1
            if not fleet[r].stepping:
                start(r)
            continue
        clock.now, r, step = heapq.heappop(steps)
        rep = fleet[r]
        for seq, _ in step.scheduled():
            if seq.num_inflight:
                seq.num_inflight -= 1
                seq.output_token_ids.append(7)
                rec = recs[seq.seq_id]
                if rec.first is None:
                    rec.first, rec.cached = clock.now, seq.num_cached_prompt_tokens
                if len(seq.output_token_ids) >= seq.max_tokens:
                    rep.sched.finish(seq, pb.FINISH_REASON_LENGTH)
                    rec.done = clock.now
        rep.publish(r)
        start(r)
    return summarize(cfg, list(recs.values()), placed, reasons)


def summarize(cfg: FleetConfig, recs: list[Rec], placed: list[int], reasons: dict) -> dict:
    span = max(r.done for r in recs) - min(r.arrival for r in recs)
    tokens = sum(r.output for r in recs)
    recs = [r for r in recs if r.arrival >= cfg.warmup]
    ttft = [r.first - r.arrival for r in recs]
    tpot = [(r.done - r.first) / max(1, r.output - 1) for r in recs]
    good = sum(1 for t, p in zip(ttft, tpot) if t <= cfg.slo_ttft and p <= cfg.slo_tpot)
    mean = sum(placed) / len(placed)
    return {"requests": len(recs), "hit_rate": sum(r.cached for r in recs) / sum(r.prompt for r in recs),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "goodput": good / (cfg.duration - cfg.warmup), "slo_met": good / len(recs),
            "tok_s": tokens / span, "imbalance": max(placed) / mean if mean else 0.0,
            "reasons": reasons}


COLUMNS = [("hit_rate", "prefix hit rate", "{:.1%}"), ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
           ("ttft_p99", "TTFT p99 (s)", "{:.3f}"), ("tpot_p50", "TPOT p50 (s)", "{:.4f}"),
           ("goodput", "goodput (req/s)", "{:.1f}"), ("slo_met", "SLO met", "{:.1%}"),
           ("tok_s", "output tok/s", "{:.0f}"), ("imbalance", "max/mean placed", "{:.2f}")]


def markdown(rows: dict[tuple[int, str], dict]) -> str:
    lines = ["| replicas | placement | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "| ---: | --- |" + " ---: |" * len(COLUMNS)]
    for (n, policy), s in rows.items():
        lines.append(f"| {n} | {policy} | " + " | ".join(fmt.format(s[k]) for k, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: dict[tuple[int, str], dict], path: pathlib.Path) -> None:
    import matplotlib  # a tool dependency ('.[bench]'), imported here only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({n for n, _ in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("hit_rate", "prefix-cache hit rate", 1.0), ("ttft_p50", "TTFT p50 / p99 (s)", None),
              ("goodput_per_replica", "goodput per replica (requests/s meeting the SLO)", None)]
    width = 0.8 / len(POLICIES)
    for ax, (key, title, top) in zip(axes, panels):
        for k, policy in enumerate(POLICIES):
            xs = [j + (k - 1) * width for j in range(len(sizes))]
            value = lambda n: rows[n, policy]["goodput"] / n if key == "goodput_per_replica" \
                else rows[n, policy][key]  # noqa: E731
            ax.bar(xs, [value(n) for n in sizes], width, label=policy)
            if key == "ttft_p50":
                ax.scatter(xs, [rows[n, policy]["ttft_p99"] for n in sizes], marker="_", s=300,
                           color="black", zorder=3, label="p99" if k == 0 else None)
        ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
        ax.set_title(title)
        if top:
            ax.set_ylim(0, top)
        if key == "ttft_p50":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="100",
                        help="fleet sizes, comma-separated, each N[:DURATION[:WARMUP]] (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=3, help="simulations in parallel")
    parser.add_argument("--out", help="folder for scaling.json and scaling.png (none if unset)")
    parser.add_argument("--plot-only", metavar="JSON", help="plot a scaling.json again (no simulation)")
    for f in dataclasses.fields(FleetConfig):
        if f.name != "replicas":
            parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                                help=f.metadata["help"] + " (default %(default)s)")
    args = parser.parse_args(argv)
    if args.plot_only:
        rows = {(r["replicas"], r["placement"]): r for r in json.loads(pathlib.Path(args.plot_only).read_text())}
        plot(rows, pathlib.Path(args.out or ".") / "scaling.png")
        return
    base = FleetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetConfig)
                          if f.name != "replicas"})
    jobs = []
    for size in args.replicas.split(","):
        n, duration, warmup = (size.split(":") + [None, None])[:3]
        cfg = dataclasses.replace(base, replicas=int(n), duration=float(duration or base.duration),
                                  warmup=float(warmup or base.warmup))
        jobs += [(cfg, p) for p in POLICIES]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(simulate, *zip(*jobs), [args.seed] * len(jobs)))
    rows = {(cfg.replicas, p): r for (cfg, p), r in zip(jobs, results)}
    print(markdown(rows))
    for (n, p), r in rows.items():
        print(f"{n} {p}: {r['requests']} requests, placements by reason {r['reasons']}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling.json").write_text(json.dumps(
            [dict(r, replicas=n, placement=p, duration=cfg.duration, warmup=cfg.warmup)
             for ((n, p), r), (cfg, _) in zip(rows.items(), jobs)], indent=1))
        plot(rows, out / "scaling.png")
        print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
