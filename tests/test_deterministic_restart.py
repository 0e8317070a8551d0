"""``headrace serve --deterministic`` through a data-plane restart: kill -9 of the data plane
during 16 sampled generations (temperature 0.8, unseeded: seed 0 in this mode), which the
control plane resumes by recompute on the restarted one; every request's tokens and logprobs
equal those of an undisturbed run, and of the same request run alone."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.test_kill_dataplane import _dataplanes, _free_port, _serving

pytestmark = pytest.mark.slow   # a serve process tree, 16 generations three times, a restart


@pytest.mark.timeout(300)
def test_a_deterministic_server_resumes_killed_generations_with_the_same_bits():
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-P", "-m", "headrace.cli", "serve", "--port", str(port),
                               "--host", "127.0.0.1", "--metrics-port", "0",
                               "--dataplane-metrics-port", "0", "--http-port", "0",
                               "--api-server-count", "1", "--deterministic"],
                              env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"),
                              start_new_session=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        _serving(channel, 120)
        stub = pb_grpc.InferenceStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).deterministic
        prompts = [f"It is a truth universally acknowledged {i}" for i in range(16)]

        def run(prompt):
            out = list(stub.Generate(pb.GenerateRequest(
                prompt=prompt, max_tokens=40, ignore_eos=True, logprobs=1,
                sampling=pb.SamplingParams(temperature=0.8)), timeout=200))
            return ([t for r in out for t in r.token_ids],
                    [lp.logprob for r in out for lp in r.logprobs])

        alone = [run(p) for p in prompts[:3]]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            undisturbed = list(pool.map(run, prompts))
        assert undisturbed[:3] == alone
        (child,) = _dataplanes(server.pid)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            time.sleep(1.0)   # generation under way
            os.kill(int(child), signal.SIGKILL)
            assert not all(f.done() for f in futures), "the kill came too late to matter"
            disturbed = [f.result(timeout=200) for f in futures]
        assert disturbed == undisturbed
        assert _dataplanes(server.pid) not in ([], [child])
        channel.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
