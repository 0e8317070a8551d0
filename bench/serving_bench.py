"""End-to-end serving benchmarks through the gRPC planes (client -> control plane -> data plane).

    python -m bench.serving_bench --model DIR --workload w1   # nano-vllm's offline throughput
    python -m bench.serving_bench --model DIR --workload w2   # single-stream TTFT / ITL
    python -m bench.serving_bench --model DIR --workload w3   # 1000-in / 1000-out throughput
    python -m bench.serving_bench --model DIR --workload w1 --api http   # the same through HTTP SSE

Starts `headrace serve` (unless --address is given) in its own process group, waits until it
is SERVING (reports the seconds to ready), runs the workload and prints a JSON line; then stops
the server by its PID (its process group if it does not exit). W1 and W3 stream from
``--clients`` processes (``bench.client_pool``; 8 by default) and report each one's CPU use
(``client_cpu_max``, ``client_limited``: whether a client process, not the server, was the
limit) and, from the data plane's /metrics, the steps and mean step times by kind and the
device's idle share (``bench.dataplane_metrics``). W2 runs from this process; with ``--stages``
the server's processes stamp each first token's path (``headrace.common.stage_times``) and the line
adds its decomposition (``first_token_ms``, ``bench.first_token``).
The workloads are defined in docs/benchmarks.md.

``--deterministic`` serves in that mode (docs/determinism.md); ``--digest tokens|logprobs``
hashes every request's output (``bench.client_pool``; ``logprobs``: the requests ask for the
sampled tokens' logprobs and the hash covers their bits), the line gains ``output_digest`` (all
requests, in order), ``--digests-out FILE`` writes each request's and ``--compare FILE`` says
how many equal another run's (``digests_vs``): a deterministic run against one of the other
mode, one alone against one in a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import grpc

from bench import client_pool, dataplane_metrics
from bench.first_token import ClientStamps, decompose
from bench.ready import wait_ready_async
from bench.serving_http import HttpTarget, run_one_http
from headrace.common.stage_times import ENV as STAGES_ENV
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc


def w1_requests():
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    return [(p, random.randint(100, 1024), 0.6) for p in prompts]


def w3_requests(n: int):
    rng = random.Random(0)
    return [([rng.randint(0, 10000) for _ in range(1000)], 1000, 0.6) for _ in range(n)]


STREAM_INTERVAL = 0   # per request; 0 = the server's default (every token)
SERVE = ["-P", "-m", "headrace.cli", "serve"]   # the `headrace serve` command line, as a module


async def run_one(stub, prompt, max_tokens, temperature, stamps: list | None = None,
                  request_id: str = "", stages: ClientStamps | None = None,
                  output: list | None = None, digest: str | None = None) -> int:
    """Streams one request; ``output`` (with ``digest``) gets its token ids and logprobs."""
    if isinstance(stub, HttpTarget):   # --api http
        return await run_one_http(stub, prompt, max_tokens, temperature, stamps)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=temperature),
                             stream_interval=STREAM_INTERVAL, request_id=request_id,
                             logprobs=int(digest == "logprobs"))
    count = 0
    if stages is not None:
        stages.sent(request_id)
    async for resp in stub.Generate(req):
        if stages is not None and not count:
            stages.first(request_id)
        count += len(resp.token_ids)
        if stamps is not None:
            stamps.append((time.perf_counter(), len(resp.token_ids)))
        if output is not None:
            output.append((list(resp.token_ids), [lp.logprob for lp in resp.logprobs]))
    return count


def digest_report(per_request: dict, args) -> dict:
    """The run's digests: one over every request in key order, written / compared as asked."""
    joined = "".join(per_request[k] for k in sorted(per_request))
    out = {"output_digest": hashlib.sha256(joined.encode()).hexdigest()[:24],
           "digested_requests": len(per_request), "digest": args.digest}
    if args.digests_out:
        with open(args.digests_out, "w") as f:
            json.dump({str(k): v for k, v in per_request.items()}, f)
    if args.compare:
        with open(args.compare) as f:
            expected = json.load(f)
        out["digests_vs"] = client_pool.compare({str(k): v for k, v in per_request.items()}, expected)
    return out


def start_py_spy(pid: int | None, out: str | None, seconds: float):
    """Samples the server's processes (control plane and data planes) with py-spy, if asked."""
    if not out or pid is None:
        return None
    cmd = ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", "250",
           "--nonblocking", "--duration", str(int(seconds)), "-o", out]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    except OSError as exc:
        print(f"py-spy unavailable: {exc}", file=sys.stderr)
        return None


async def throughput(stub, requests, args, profile=lambda: None) -> dict:
    """The requests from ``--clients`` processes, all sent at once."""
    await run_one(stub, [1, 2, 3], 4, 0.6)    # warm-up
    spy = profile()
    before = dataplane_metrics.snapshot(args.dataplane_metrics)
    items = [(0.0, p, m, temp, STREAM_INTERVAL, i) for i, (p, m, temp) in enumerate(requests)]
    results, usage, t0 = await asyncio.to_thread(
        client_pool.run, args.address, items, args.clients, args.channels,
        args.http_url if args.api == "http" else None, 3.0, getattr(args, "digest", None))
    steps = dataplane_metrics.delta(before, dataplane_metrics.snapshot(args.dataplane_metrics))
    if spy is not None:
        spy.wait(60)
    ok = [r for r in results if r["ok"]]
    wall, tokens = max((r["end"] for r in ok), default=t0) - t0, sum(r["tokens"] for r in ok)
    return {"requests": len(requests), "failed": len(results) - len(ok), "output_tokens": tokens,
            "wall_s": round(wall, 3), "output_tok_per_s": round(tokens / wall, 1) if wall > 0 else 0,
            "stream_interval": STREAM_INTERVAL, "device_s": steps["device_busy_s"],
            "device_idle_s": steps["device_idle_s"], "device_idle_share": steps["device_idle_share"],
            "steps": sum(k["steps"] for k in steps["steps_by_kind"].values()),
            "steps_by_kind": steps["steps_by_kind"], **usage,
            "first_error": next((r["error"] for r in results if not r["ok"]), None),
            **(digest_report(client_pool.digests(results), args) if getattr(args, "digest", None) else {})}


async def latency(stub, repeats: int = 5, stages_dir: str | None = None, args=None) -> dict:
    rng = random.Random(0)
    await run_one(stub, [1, 2, 3], 8, 0.0)
    ttfts, itls, ids, per_request = [], [], [], {}
    stages = ClientStamps(stages_dir) if stages_dir else None
    digest = getattr(args, "digest", None)
    for i in range(repeats):
        prompt = [rng.randint(0, 10000) for _ in range(128)]
        stamps: list = []
        output: list | None = [] if digest else None
        start = time.perf_counter()
        ids.append(f"w2-{i}-{time.time_ns()}")
        await run_one(stub, prompt, 256, 0.0, stamps, ids[-1], stages, output, digest)
        if output is not None:
            per_request[i] = client_pool.output_digest(
                [t for toks, _ in output for t in toks],
                [lp for _, lps in output for lp in lps] if digest == "logprobs" else None)
        ttfts.append(stamps[0][0] - start)
        for (t0, _), (t1, n) in zip(stamps, stamps[1:]):
            itls.extend([(t1 - t0) / n] * n)
    itls.sort()
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    out = {"ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 2),
           "itl_ms_p50": round(q(itls, 0.5), 3), "itl_ms_p99": round(q(itls, 0.99), 3),
           "tokens": len(itls) + repeats}
    if stages is not None:
        out["first_token_ms"] = decompose(stages_dir, ids)
    if digest:
        out.update(digest_report(per_request, args))
    return out


async def main_async(args) -> dict:
    async with grpc.aio.insecure_channel(args.address, options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        t0 = time.perf_counter()
        await wait_ready_async(args.address, getattr(args, "server", None))
        ready = time.perf_counter() - t0
        stub = pb_grpc.InferenceStub(channel)
        if args.api == "http":
            stub = HttpTarget(args.http_url)
        profile = lambda: start_py_spy(args.server_pid, args.py_spy, args.py_spy_seconds)  # noqa: E731
        if args.workload == "w1":
            out = await throughput(stub, w1_requests()[:args.num_seqs or None], args, profile)
        elif args.workload == "w3":
            out = await throughput(stub, w3_requests(args.num_seqs or 512), args, profile)
        else:
            out = await latency(stub, args.repeats, args.stages, args)
        if args.api == "http":
            await stub.close()
        out.update(workload=args.workload, seconds_to_ready=round(ready, 1), api=args.api,
                   label=args.label, deterministic=args.deterministic)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1")
    ap.add_argument("--address", default=None, help="use a running server instead of starting one")
    ap.add_argument("--port", type=int, default=50151)
    ap.add_argument("--num-seqs", type=int, default=0,
                    help="w3: sequences (0: 512); w1: only the first N of its 256 (0: all; a smoke run)")
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 16384",
                    help="W1 uses nano-vllm's own default step budget (16,384 tokens)")
    ap.add_argument("--stream-interval", type=int, default=0,
                    help="tokens per streamed message the requests ask for (0: server default; "
                         "100000: one message per request, an offline client)")
    ap.add_argument("--api", choices=["grpc", "http"], default="grpc",
                    help="http: the same requests through /v1/completions with SSE streaming")
    ap.add_argument("--http-url", default=None,
                    help="--api http with --address: the server's HTTP base URL (default port 8000)")
    ap.add_argument("--clients", type=int, default=8,
                    help="w1/w3: client processes streaming the requests (bench.client_pool)")
    ap.add_argument("--channels", type=int, default=4, help="w1/w3: connections per client process")
    ap.add_argument("--repeats", type=int, default=5, help="w2: requests, one after the other")
    ap.add_argument("--stages", default=None,
                    help="w2: a directory: the server's processes stamp each first token's path there "
                         "(HEADRACE_STAGE_TIMES; for --address, set it on the server) and the line "
                         "adds the decomposition")
    ap.add_argument("--dataplane-metrics", default="http://127.0.0.1:9401/metrics",
                    help="w1/w3: the data plane's /metrics (steps by kind, device idle)")
    ap.add_argument("--label", default="", help="a name for this run in its JSON line (bench.gpu_table)")
    ap.add_argument("--py-spy", default=None, help="w1/w3: write py-spy raw stacks of the server here")
    ap.add_argument("--py-spy-seconds", type=float, default=8)
    ap.add_argument("--deterministic", action="store_true",
                    help="serve with --deterministic (batch-invariant kernels; docs/determinism.md)")
    ap.add_argument("--digest", choices=["tokens", "logprobs"], default=None,
                    help="hash each request's output (logprobs: their bits too; the requests ask "
                         "for them): output_digest in the line")
    ap.add_argument("--digests-out", default=None, help="--digest: write each request's digest here (JSON)")
    ap.add_argument("--compare", default=None,
                    help="--digest: a --digests-out file of another run; the line says how many equal")
    args = ap.parse_args()
    server, args.server_pid, args.server = None, None, None
    global STREAM_INTERVAL
    STREAM_INTERVAL = args.stream_interval
    if args.address is None:
        args.address = f"127.0.0.1:{args.port}"
        cmd = [sys.executable, *SERVE, "--model", args.model,
               "--host", "127.0.0.1", "--port", str(args.port), "--http-port", str(args.port + 1),
               *args.serve_args.split(), *(["--deterministic"] if args.deterministic else [])]
        args.http_url = args.http_url or f"http://127.0.0.1:{args.port + 1}"
        env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
        if args.stages:
            env[STAGES_ENV] = args.stages
        server = args.server = subprocess.Popen(cmd, env=env, start_new_session=True)
        args.server_pid = server.pid
    if args.http_url is None:
        args.http_url = f"http://{args.address.rsplit(':', 1)[0]}:8000"
    try:
        print(json.dumps(asyncio.run(main_async(args))), flush=True)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:   # the server and the data planes it started
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


if __name__ == "__main__":
    main()
