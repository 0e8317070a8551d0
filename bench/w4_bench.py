"""W4: serving under load (docs/benchmarks.md). Poisson arrivals at a sweep of request rates,
a fixed seeded long-tailed (lognormal) length distribution with mean ~200 prompt / ~180 output
tokens, every token streamed over gRPC by clients spread over several processes; per rate it
reports request and output-token throughput, TTFT / ITL / end-to-end p50 and p99, goodput
under the SLO (TTFT <= 200 ms and the request's ITL p99 <= 50 ms, per request, as
`vllm bench serve --goodput` counts it) and whether the rate meets the SLO (TTFT p99 and ITL
p99 of all requests within it); then the highest rate that does.

    python -m bench.w4_bench --model /tmp/qwen3 --api-server-counts 1,2,4 --out-dir docs

Starts `headrace serve --api-server-count N` per N (unless --address is given), like
bench.serving_bench. Writes w4.json and, when matplotlib is installed, w4.png (latency
against request rate, one line per N) to --out-dir; prints one JSON line per N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

SLO_TTFT_S, SLO_ITL_S = 0.200, 0.050


def lengths(n: int, mean: float, seed: int, sigma: float = 1.0, low: int = 4, high: int = 2048) -> list[int]:
    """Lognormal lengths with the given mean (before clipping), seeded."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [min(high, max(low, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def workload(rate: float, duration: float, seed: int, prompt_mean: float, output_mean: float,
             max_length: int = 1024):
    """[(send offset s, prompt ids, max_tokens)] with Poisson arrivals at ``rate`` per second;
    prompt and output lengths each at most ``max_length``."""
    rng = random.Random(seed)
    n = max(1, int(rate * duration))
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


async def _one(stub, pb, prompt, max_tokens, start_at: float) -> dict:
    await asyncio.sleep(max(0.0, start_at - time.time()))
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0))
    sent, stamps = time.perf_counter(), []
    try:
        async for resp in stub.Generate(req, timeout=600):
            stamps.append((time.perf_counter(), len(resp.token_ids)))
    except Exception as exc:  # noqa: BLE001 - counted as failed
        return {"ok": False, "error": repr(exc)[:200]}
    itls = [(t1 - t0) / n for (t0, _), (t1, n) in zip(stamps, stamps[1:]) for _ in range(n)]
    return {"ok": True, "ttft": stamps[0][0] - sent, "e2e": stamps[-1][0] - sent, "itls": itls,
            "tokens": sum(n for _, n in stamps), "end": time.time()}


def _client(address: str, items: list, t0: float, channels: int) -> list[dict]:
    """One client process: its share of the requests over a few connections (each may reach
    another front end)."""
    import grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    async def run():
        chans = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(channels)]
        stubs = [pb_grpc.InferenceStub(c) for c in chans]
        results = await asyncio.gather(*(_one(stubs[i % channels], pb, p, m, t0 + off)
                                         for i, (off, p, m) in enumerate(items)))
        for c in chans:
            await c.close()
        return results

    return asyncio.run(run())


def run_rate(address: str, rate: float, args, items: list | None = None) -> dict:
    """One rate of ``workload`` (or of ``items``: [(send offset s, prompt ids, max_tokens)])."""
    if items is None:
        items = workload(rate, args.duration, args.seed, args.prompt_mean, args.output_mean, args.max_length)
    t0 = time.time() + 3.0   # the client processes start meanwhile
    shares = [items[i::args.clients] for i in range(args.clients)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.clients) as pool:
        parts = pool.starmap(_client, [(address, s, t0, args.channels) for s in shares])
    results = [r for part in parts for r in part]
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
    return out


def start_server(args, count: int):
    cmd = [sys.executable, "-m", "cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--http-port", "0", "--api-server-count", str(count),
           *args.serve_args.split()]
    return subprocess.Popen(cmd, env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"), start_new_session=True)


def stop_server(server) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:   # the server and the children it started
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def sweep(address: str, args) -> list[dict]:
    from headrace_client import AsyncClient, NotReady

    try:
        asyncio.run(AsyncClient(address).wait_ready(900))
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    run_rate(address, 2.0, argparse.Namespace(**{**vars(args), "duration": 2.0}))   # warm-up
    return [run_rate(address, rate, args) for rate in args.rates]


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
    ap.add_argument("--api-server-counts", default="1", help="comma-separated N to sweep (e.g. 1,2,4)")
    ap.add_argument("--rates", default="40,80,120,160", help="comma-separated request rates (req/s)")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--channels", type=int, default=4, help="connections per client process")
    ap.add_argument("--prompt-mean", type=float, default=200)
    ap.add_argument("--output-mean", type=float, default=180)
    ap.add_argument("--max-length", type=int, default=1024, help="longest prompt, longest output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="write w4.json (and w4.png) here")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    counts = [int(c) for c in args.api_server_counts.split(",")]
    runs = {}
    for count in counts:
        server = None
        if args.address is None:
            server = start_server(args, count)
        try:
            rows = sweep(args.address or f"127.0.0.1:{args.port}", args)
        finally:
            if server is not None:
                stop_server(server)
        runs[count] = rows
        best = max((r["rate"] for r in rows if r["meets_slo"]), default=None)
        print(json.dumps({"workload": "w4", "api_server_count": count, "max_rate_at_slo": best,
                          "rates": rows}), flush=True)
    if args.out_dir:
        out = pathlib.Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "w4.json").write_text(json.dumps(
            {"slo": {"ttft_ms": SLO_TTFT_S * 1e3, "itl_p99_ms": SLO_ITL_S * 1e3}, "runs": runs}, indent=1))
        plot(runs, out / "w4.png")


if __name__ == "__main__":
    main()
