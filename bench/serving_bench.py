"""End-to-end serving benchmarks through the gRPC planes (client -> control plane -> data plane).

    python -m bench.serving_bench --model DIR --workload w1   # nano-vllm's offline throughput
    python -m bench.serving_bench --model DIR --workload w2   # single-stream TTFT / ITL
    python -m bench.serving_bench --model DIR --workload w3   # 1000-in / 1000-out throughput
    python -m bench.serving_bench --model DIR --workload w1 --api http   # the same through HTTP SSE

Starts `headrace serve` (unless --address is given) in its own process group, waits until it
is SERVING (reports the seconds to ready), runs the workload from an asyncio gRPC client and
prints a JSON line; then stops the server by its PID (its process group if it does not exit).
The workloads are defined in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import grpc

from bench.serving_http import HttpTarget, run_one_http
from headrace_client import AsyncClient, NotReady
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
SERVE = ["-m", "cli", "serve"]   # the `headrace serve` command line, as a module


def device_seconds(port: int = 9401) -> tuple[float, float, float]:
    """(device time of steps, device idle time, steps) so far, from the data plane's /metrics."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0, 0.0, 0.0
    values = {}
    for line in text.splitlines():   # summed over labels (the step kinds)
        name, _, value = line.rpartition(" ")
        name = name.partition("{")[0]
        if name in ("headrace:dataplane_step_device_seconds_sum", "headrace:dataplane_device_idle_seconds_total",
                    "headrace:dataplane_steps_total"):
            values[name] = values.get(name, 0.0) + float(value)
    return (values.get("headrace:dataplane_step_device_seconds_sum", 0.0),
            values.get("headrace:dataplane_device_idle_seconds_total", 0.0),
            values.get("headrace:dataplane_steps_total", 0.0))


async def run_one(stub, prompt, max_tokens, temperature, stamps: list | None = None) -> int:
    if isinstance(stub, HttpTarget):   # --api http
        return await run_one_http(stub, prompt, max_tokens, temperature, stamps)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=temperature),
                             stream_interval=STREAM_INTERVAL)
    count = 0
    async for resp in stub.Generate(req):
        count += len(resp.token_ids)
        if stamps is not None:
            stamps.append((time.perf_counter(), len(resp.token_ids)))
    return count


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


async def throughput(stub, requests, profile=lambda: None) -> dict:
    await run_one(stub, [1, 2, 3], 4, 0.6)    # warm-up
    spy = profile()
    dev0, idle0, steps0 = device_seconds()
    start = time.perf_counter()
    counts = await asyncio.gather(*(run_one(stub, *r) for r in requests))
    wall = time.perf_counter() - start
    dev1, idle1, steps1 = device_seconds()
    if spy is not None:
        spy.wait(60)
    return {"requests": len(requests), "output_tokens": sum(counts), "wall_s": round(wall, 3),
            "output_tok_per_s": round(sum(counts) / wall, 1), "stream_interval": STREAM_INTERVAL,
            "device_s": round(dev1 - dev0, 3), "device_idle_s": round(idle1 - idle0, 3),
            "steps": int(steps1 - steps0)}


async def latency(stub, repeats: int = 5) -> dict:
    rng = random.Random(0)
    await run_one(stub, [1, 2, 3], 8, 0.0)
    ttfts, itls = [], []
    for _ in range(repeats):
        prompt = [rng.randint(0, 10000) for _ in range(128)]
        stamps: list = []
        start = time.perf_counter()
        await run_one(stub, prompt, 256, 0.0, stamps)
        ttfts.append(stamps[0][0] - start)
        for (t0, _), (t1, n) in zip(stamps, stamps[1:]):
            itls.extend([(t1 - t0) / n] * n)
    itls.sort()
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    return {"ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 2),
            "itl_ms_p50": round(q(itls, 0.5), 3), "itl_ms_p99": round(q(itls, 0.99), 3),
            "tokens": len(itls) + repeats}


async def main_async(args) -> dict:
    async with grpc.aio.insecure_channel(args.address, options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        t0 = time.perf_counter()
        try:
            await AsyncClient(args.address).wait_ready(900)
        except NotReady as exc:
            raise SystemExit(str(exc)) from None
        ready = time.perf_counter() - t0
        stub = pb_grpc.InferenceStub(channel)
        if args.api == "http":
            stub = HttpTarget(args.http_url)
        profile = lambda: start_py_spy(args.server_pid, args.py_spy, args.py_spy_seconds)  # noqa: E731
        if args.workload == "w1":
            out = await throughput(stub, w1_requests(), profile)
        elif args.workload == "w3":
            out = await throughput(stub, w3_requests(args.num_seqs), profile)
        else:
            out = await latency(stub)
        if args.api == "http":
            await stub.close()
        out.update(workload=args.workload, seconds_to_ready=round(ready, 1), api=args.api)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1")
    ap.add_argument("--address", default=None, help="use a running server instead of starting one")
    ap.add_argument("--port", type=int, default=50151)
    ap.add_argument("--num-seqs", type=int, default=512, help="w3: sequences")
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 16384",
                    help="W1 uses nano-vllm's own default step budget (16,384 tokens)")
    ap.add_argument("--stream-interval", type=int, default=0,
                    help="tokens per streamed message the requests ask for (0: server default; "
                         "100000: one message per request, an offline client)")
    ap.add_argument("--api", choices=["grpc", "http"], default="grpc",
                    help="http: the same requests through /v1/completions with SSE streaming")
    ap.add_argument("--http-url", default=None,
                    help="--api http with --address: the server's HTTP base URL (default port 8000)")
    ap.add_argument("--py-spy", default=None, help="w1/w3: write py-spy raw stacks of the server here")
    ap.add_argument("--py-spy-seconds", type=float, default=8)
    args = ap.parse_args()
    server, args.server_pid = None, None
    global STREAM_INTERVAL
    STREAM_INTERVAL = args.stream_interval
    if args.address is None:
        args.address = f"127.0.0.1:{args.port}"
        cmd = [sys.executable, *SERVE, "--model", args.model,
               "--host", "127.0.0.1", "--port", str(args.port), "--http-port", str(args.port + 1),
               *args.serve_args.split()]
        args.http_url = args.http_url or f"http://127.0.0.1:{args.port + 1}"
        server = subprocess.Popen(cmd, env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"),
                                  start_new_session=True)
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
