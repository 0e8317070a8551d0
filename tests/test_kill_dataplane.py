"""kill -9 of `headrace serve`'s data plane during 32 concurrent generations: the supervisor
restarts it, the control plane reconnects and resumes every request by recompute, and all 32
finish with the same text as an undisturbed run; KV blocks are back to baseline afterwards."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from tests.harness import completion
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow   # a serve process tree, 32 generations twice, a restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(channel, timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became ready")


def _dataplanes(parent: int) -> list[str]:
    """The data plane children of ``parent`` (serve also runs the engine core and front ends)."""
    pids = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [p for p in pids if b"dataplane" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]


@pytest.mark.timeout(240)
def test_kill_9_of_the_data_plane_during_32_generations():
    port, metrics_port = _free_port(), _free_port()
    env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
    server = subprocess.Popen([sys.executable, "-P", "-m", "headrace.cli", "serve", "--port", str(port),
                               "--host", "127.0.0.1", "--metrics-port", str(metrics_port),
                               "--dataplane-metrics-port", "0", "--http-port", "0"],
                              env=env, start_new_session=True)

    def gauge(name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        _serving(channel, 120)
        stub = pb_grpc.InferenceStub(channel)
        prompts = [f"It is a truth universally acknowledged {i}" for i in range(32)]

        def run(prompt):
            return completion(list(stub.Generate(pb.GenerateRequest(
                prompt=prompt, max_tokens=48, ignore_eos=True, sampling=pb.SamplingParams(temperature=0)),
                timeout=180)))

        with concurrent.futures.ThreadPoolExecutor(32) as pool:   # greedy: batching changes nothing
            undisturbed = list(pool.map(run, prompts))
        (child,) = _dataplanes(server.pid)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            deadline = time.monotonic() + 30
            while gauge("headrace:num_requests_running") < 16 and time.monotonic() < deadline:
                time.sleep(0.01)   # generation under way for most of them
            os.kill(int(child), signal.SIGKILL)
            assert all(not f.done() for f in futures[-4:]), "the kill came too late to matter"
            disturbed = [f.result(timeout=180) for f in futures]
        assert disturbed == undisturbed
        restarted = _dataplanes(server.pid)
        assert restarted and restarted != [child]
        total = gauge("headrace:num_kv_blocks")
        deadline = time.monotonic() + 10
        while gauge("headrace:num_free_kv_blocks") != total and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauge("headrace:num_free_kv_blocks") == total > 0
        channel.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
