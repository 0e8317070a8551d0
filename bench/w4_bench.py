"""W4: serving under load (docs/benchmarks.md). Poisson arrivals at a sweep of request rates,
a fixed seeded long-tailed (lognormal) length distribution with mean ~200 prompt / ~180 output
tokens, every token streamed over gRPC by clients spread over several processes
(``bench.client_pool``); per rate it reports request and output-token throughput, TTFT / ITL /
end-to-end p50 and p99, goodput under the SLO (TTFT <= 200 ms and the request's ITL p99 <= 50
ms, per request, as `vllm bench serve --goodput` counts it), whether the rate meets the SLO
(TTFT p99 and ITL p99 of all requests within it), the client processes' CPU use
(``client_limited``: one was the limit), and from the data plane's /metrics the steps, mean
execute and device ms per step by kind and the device's idle share
(``bench.dataplane_metrics``); then the highest rate that meets the SLO (``--search N``: N more
runs bisecting towards it).

    python -m bench.w4_bench --model /tmp/qwen3 --api-server-counts 1,2,4 --out-dir docs

Starts `headrace serve --api-server-count N` per N (unless --address is given), like
bench.serving_bench. Writes w4.json and, when matplotlib is installed, w4.png (latency
against request rate, one line per N) to --out-dir; prints one JSON line per N.

``--deterministic`` serves in that mode (docs/determinism.md) and ``--digest tokens|logprobs``
hashes each request's output (``output_digest`` per rate). ``--identity N`` instead plays the
same N requests (arrival times aside) at each of ``--rates`` and then alone, one after the
other (every ``--alone-every``-th of them), and prints how many outputs equal the first rate's
and the alone ones (issue 54's target: all, tokens and logprobs, with ``--deterministic``):

    python -m bench.w4_bench --model /tmp/qwen3 --deterministic --identity 1000 --rates 60,120,180 --digest logprobs
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys

from bench import client_pool, dataplane_metrics
from bench.ready import wait_ready

SLO_TTFT_S, SLO_ITL_S = 0.200, 0.050


def lengths(n: int, mean: float, seed: int, sigma: float = 1.0, low: int = 4, high: int = 2048) -> list[int]:
    """Lognormal lengths with the given mean (before clipping), seeded."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [min(high, max(low, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def workload(rate: float, duration: float, seed: int, prompt_mean: float, output_mean: float,
             max_length: int = 1024, n: int | None = None):
    """[(send offset s, prompt ids, max_tokens)] with Poisson arrivals at ``rate`` per second;
    prompt and output lengths each at most ``max_length``; ``n`` requests (default: ``rate x
    duration``): the same prompts and lengths at any rate."""
    rng = random.Random(seed)
    n = n or max(1, int(rate * duration))
    prompts = lengths(n, prompt_mean, seed + 1, high=max_length)
    outputs = lengths(n, output_mean, seed + 2, high=max_length)
    t, out = 0.0, []
    for p, o in zip(prompts, outputs):   # token ids any model's vocabulary has (random weights)
        out.append((t, [rng.randint(10, 2000) for _ in range(p)], o))
        t += rng.expovariate(rate)
    return out


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_rate(address: str, rate: float, args, items: list | None = None) -> dict:
    """One rate of ``workload`` (or of ``items``: [(send offset s, prompt ids, max_tokens[,
    model])], model: a LoRA adapter's name)."""
    if items is None:
        items = workload(rate, args.duration, args.seed, args.prompt_mean, args.output_mean, args.max_length)
    temperature, digest = getattr(args, "temperature", 0.0), getattr(args, "digest", None)
    # greedy by default, the server's stream interval; each request keyed by its index (and its
    # LoRA adapter, where the items name one)
    items = [(off, p, m, temperature, 0, i, *model) for i, (off, p, m, *model) in enumerate(items)]
    url = getattr(args, "dataplane_metrics", None)   # (bench.dp_bench: none)
    before = dataplane_metrics.snapshot(url) if url else {}
    results, usage, t0 = client_pool.run(address, items, args.clients, args.channels, digest=digest)
    steps = dataplane_metrics.delta(before, dataplane_metrics.snapshot(url) if url else {})
    ok = [r for r in results if r["ok"]]
    wall = max((r["end"] for r in ok), default=t0) - t0
    ttfts, e2es = [r["ttft"] for r in ok], [r["e2e"] for r in ok]
    itls = [x for r in ok for x in r["itls"]]
    good = [r for r in ok if r["ttft"] <= SLO_TTFT_S and quantile(r["itls"], 0.99) <= SLO_ITL_S
            or (r["ttft"] <= SLO_TTFT_S and not r["itls"])]
    ms = lambda x: round(x * 1e3, 2)  # noqa: E731
    out = {"rate": rate, "requests": len(results), "failed": len(results) - len(ok),
           "wall_s": round(wall, 2), "request_per_s": round(len(ok) / wall, 2) if wall > 0 else 0,
           "output_tok_per_s": round(sum(r["tokens"] for r in ok) / wall, 1) if wall > 0 else 0,
           "ttft_ms_p50": ms(quantile(ttfts, .5)), "ttft_ms_p99": ms(quantile(ttfts, .99)),
           "itl_ms_p50": ms(quantile(itls, .5)), "itl_ms_p99": ms(quantile(itls, .99)),
           "e2e_ms_p50": ms(quantile(e2es, .5)), "e2e_ms_p99": ms(quantile(e2es, .99)),
           "goodput_req_per_s": round(len(good) / wall, 2) if wall > 0 else 0,
           "first_error": next((r["error"] for r in results if not r["ok"]), None)}
    out["meets_slo"] = (not out["failed"] and quantile(ttfts, .99) <= SLO_TTFT_S
                        and quantile(itls, .99) <= SLO_ITL_S)
    if digest:
        out["_digests"] = client_pool.digests(results)
        joined = "".join(out["_digests"][k] for k in sorted(out["_digests"]))
        out["output_digest"] = hashlib.sha256(joined.encode()).hexdigest()[:24]
    return out | usage | steps


def run_alone(address: str, items: list, args) -> dict:
    """``items`` one at a time from this process (nothing else in the server): key -> digest."""
    import grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    async def run():
        out = {}
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for key, prompt, max_tokens in items:
                req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                         ignore_eos=True, logprobs=int(args.digest == "logprobs"),
                                         sampling=pb.SamplingParams(temperature=args.temperature))
                ids, logprobs = [], []
                async for resp in stub.Generate(req, timeout=600):
                    ids.extend(resp.token_ids)
                    logprobs.extend(lp.logprob for lp in resp.logprobs)
                out[key] = client_pool.output_digest(ids, logprobs if args.digest == "logprobs" else None)
        return out

    return asyncio.run(run())


def identity(address: str, args) -> dict:
    """The same ``--identity`` requests at each rate, then alone: how many outputs agree."""
    wait_ready(address, getattr(args, "server", None))
    n = args.identity
    rows = []
    for rate in args.rates:
        items = workload(rate, n / rate, args.seed, args.prompt_mean, args.output_mean,
                         args.max_length, n=n)
        rows.append(run_rate(address, rate, args, items))
    first = rows[0]["_digests"]
    out = {"workload": "w4-identity", "requests": n, "digest": args.digest,
           "deterministic": args.deterministic, "temperature": args.temperature,
           "rates": [{k: r[k] for k in ("rate", "request_per_s", "failed", "output_digest",
                                        "ttft_ms_p99", "itl_ms_p99", "meets_slo")}
                     | {"vs_first_rate": client_pool.compare(r["_digests"], first)} for r in rows]}
    out["identical_across_rates"] = all(r["vs_first_rate"]["identical"] for r in out["rates"])
    if args.alone_every:
        items = workload(args.rates[0], n / args.rates[0], args.seed, args.prompt_mean,
                         args.output_mean, args.max_length, n=n)
        picked = [(i, p, m) for i, (_, p, m) in enumerate(items) if i % args.alone_every == 0]
        alone = run_alone(address, picked, args)
        out["alone"] = client_pool.compare(alone, {k: first.get(k) for k in alone})
    return out


def start_server(args, count: int):
    """``headrace serve`` with ``count`` API front ends (0: its default for this machine)."""
    cmd = [sys.executable, "-P", "-m", "headrace.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--http-port", "0",
           *(["--api-server-count", str(count)] if count else []), *args.serve_args.split(),
           *(["--deterministic"] if getattr(args, "deterministic", False) else [])]
    return subprocess.Popen(cmd, env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"), start_new_session=True)


def stop_server(server) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:   # the server and the children it started
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def sweep(address: str, args) -> list[dict]:
    """The rates asked for, then ``--search`` more runs closing in on the highest rate that
    meets the SLO: between the best that met it and the lowest above that failed (bisection);
    above every rate when all met it (x1.25), below when none did (halving)."""
    wait_ready(address, getattr(args, "server", None))
    run_rate(address, 2.0, argparse.Namespace(**{**vars(args), "duration": 2.0}))   # warm-up
    rows = [run_rate(address, rate, args) for rate in args.rates]
    for _ in range(args.search):
        rate = next_rate(rows)
        if rate is None:
            break
        rows.append(run_rate(address, rate, args))
    return sorted(rows, key=lambda r: r["rate"])


def next_rate(rows: list[dict], resolution: float = 5.0) -> float | None:
    """The next rate to try when looking for the highest one that meets the SLO (None: found
    within ``resolution`` req/s)."""
    met = [r["rate"] for r in rows if r["meets_slo"]]
    best = max(met, default=None)
    above = [r["rate"] for r in rows if not r["meets_slo"] and (best is None or r["rate"] > best)]
    if best is None:
        return round(min(above) / 2, 1)
    if not above:
        return round(best * 1.25, 1)
    low = min(above)
    return None if low - best <= resolution else round((best + low) / 2, 1)


def plot(runs: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for count, rows in runs.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_ms_p99"] for r in rows], marker="o", label=f"N={count} p99")
        axes[0].plot(rates, [r["ttft_ms_p50"] for r in rows], ls="--", label=f"N={count} p50")
        axes[1].plot(rates, [r["itl_ms_p99"] for r in rows], marker="o", label=f"N={count} p99")
    axes[0].axhline(SLO_TTFT_S * 1e3, color="grey", lw=0.8)
    axes[1].axhline(SLO_ITL_S * 1e3, color="grey", lw=0.8)
    for ax, name in zip(axes, ("TTFT (ms)", "ITL (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle("W4: latency against request rate, by API front ends (N)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--address", default=None, help="use a running server (one N) instead of starting one")
    ap.add_argument("--port", type=int, default=50161)
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 8192")
    ap.add_argument("--api-server-counts", default="1",
                    help="comma-separated N to sweep (e.g. 1,2,4; 0: serve's default for this machine)")
    ap.add_argument("--rates", default="40,80,120,160", help="comma-separated request rates (req/s)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    ap.add_argument("--clients", type=int, default=4, help="client processes (bench.client_pool)")
    ap.add_argument("--channels", type=int, default=4, help="connections per client process")
    ap.add_argument("--prompt-mean", type=float, default=200)
    ap.add_argument("--output-mean", type=float, default=180)
    ap.add_argument("--max-length", type=int, default=1024, help="longest prompt, longest output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--search", type=int, default=0,
                    help="more runs after --rates, closing in on the highest rate that meets the SLO")
    ap.add_argument("--dataplane-metrics", default="http://127.0.0.1:9401/metrics",
                    help="the data plane's /metrics (step time by kind, device idle share per rate)")
    ap.add_argument("--out-dir", default=None, help="write w4.json (and w4.png) here")
    ap.add_argument("--deterministic", action="store_true",
                    help="serve with --deterministic (batch-invariant kernels; docs/determinism.md)")
    ap.add_argument("--digest", choices=["tokens", "logprobs"], default=None,
                    help="hash each request's output (logprobs: their bits too): output_digest per rate")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' temperature (0: greedy, W4's; > 0: unseeded sampling)")
    ap.add_argument("--identity", type=int, default=0,
                    help="N: the same N requests at each rate of --rates, then alone (see above)")
    ap.add_argument("--alone-every", type=int, default=1,
                    help="--identity: run every K-th request alone (0: none)")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.identity:
        args.digest = args.digest or "logprobs"
        server = args.server = (start_server(args, int(args.api_server_counts.split(",")[0]))
                                if args.address is None else None)
        try:
            print(json.dumps(identity(args.address or f"127.0.0.1:{args.port}", args)), flush=True)
        finally:
            if server is not None:
                stop_server(server)
        return
    from headrace.cli.processes import default_api_server_count

    counts = [int(c) or default_api_server_count() for c in args.api_server_counts.split(",")]
    runs = {}
    for count in counts:
        server = args.server = None
        if args.address is None:
            server = args.server = start_server(args, count)
        try:
            rows = sweep(args.address or f"127.0.0.1:{args.port}", args)
        finally:
            if server is not None:
                stop_server(server)
        runs[count] = rows
        best = max((r["rate"] for r in rows if r["meets_slo"]), default=None)
        for r in rows:
            r.pop("_digests", None)
        print(json.dumps({"workload": "w4", "api_server_count": count, "max_rate_at_slo": best,
                          "deterministic": args.deterministic, "rates": rows}), flush=True)
    if args.out_dir:
        out = pathlib.Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "w4.json").write_text(json.dumps(
            {"slo": {"ttft_ms": SLO_TTFT_S * 1e3, "itl_p99_ms": SLO_ITL_S * 1e3}, "runs": runs}, indent=1))
        plot(runs, out / "w4.png")


if __name__ == "__main__":
    main()
