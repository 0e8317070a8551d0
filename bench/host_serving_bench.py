"""The gRPC planes' host chain at batch 1, with no device: W2 (one stream, greedy) through a
real control plane process and a data plane process whose model is replaced by constant
logits (bench/host_bench.py). Its inter-token latency is what the planes' Python and gRPC cost
per step; on a GPU, W2's ITL is about max(device step, this chain) with two steps in flight.

    python -P bench/host_serving_bench.py [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import grpc


def run_worker(address: str, vocab: int) -> None:
    from dataplane.server import serve
    from host_bench import HostOnlyWorker

    server = serve(HostOnlyWorker(vocab=vocab), address)
    signal.sigwait([signal.SIGTERM, signal.SIGINT])
    server.stop(0)


async def measure(address: str) -> dict:
    from cli.client import wait_until_serving
    from headrace.v1 import inference_pb2_grpc as pb_grpc
    from serving_bench import latency

    async with grpc.aio.insecure_channel(address) as channel:
        if not await wait_until_serving(channel, 120):
            raise SystemExit("control plane never became ready")
        return await latency(pb_grpc.InferenceStub(channel))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", default=None, help="checkpoint dir for the tokenizer "
                    "(default: a random qwen3-tiny written to a temp dir)")
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=16384, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=50171)
    args = ap.parse_args()
    if args.role == "worker":
        return run_worker(args.address, args.vocab)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="headrace-hostserve-"))
    model = args.tokenizer
    if model is None:
        model = str(tmp / "qwen3-tiny")
        subprocess.run([sys.executable, "bench/random_checkpoint.py", "qwen3-tiny", model], check=True,
                       stdout=subprocess.DEVNULL)
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    sock = f"unix:{tmp}/worker.sock"
    env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
    worker = subprocess.Popen([sys.executable, "-P", __file__, "--role", "worker", "--address", sock,
                               "--vocab", str(vocab)], env=env)
    control = subprocess.Popen([sys.executable, "-m", "cli", "controlplane", "--model", model,
                                "--workers", sock, "--port", str(args.port), "--metrics-port", "0"], env=env)
    try:
        time.sleep(1)
        out = asyncio.run(measure(f"127.0.0.1:{args.port}"))
        out.update(workload="w2-host-chain")
        print(json.dumps(out), flush=True)
    finally:
        for proc in (control, worker):
            proc.send_signal(signal.SIGTERM)
        for proc in (control, worker):
            proc.wait(30)


if __name__ == "__main__":
    main()
