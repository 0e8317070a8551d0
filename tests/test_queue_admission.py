"""The queue bound where the queue is (the engine core): a request weighs n samples times its
prompts against ``--max-queued`` and ``--max-n``; submissions arriving together cannot jointly
pass it; a front end's early check reads the queue length the core pushes on every change, so a
burst that is cancelled never leaves it refusing (the wedge of issue 29); an HTTP body lists
``--max-prompts-per-request`` prompts at most; health is NOT_SERVING when the server cannot
admit work for another reason than load."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.controlplane.requests import limits
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.server import serve
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion
from tests.test_scheduler import make_request

MODEL = str(default_model_dir())
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_request_weighs_its_n_samples_in_the_queue():
    sched = Scheduler(BlockManager(64, 4), max_running=4, max_batched_tokens=64)
    sched.add(make_request(8, n=4).sequences)
    assert sched.num_queued == 4 and len(sched.waiting) == 1
    assert limits.queue_refusal(8, sched.num_queued, 4) is None
    code, message = limits.queue_refusal(7, sched.num_queued, 4)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued" in message
    code, message = limits.queue_refusal(3, 0, 4)   # could never fit: not worth a retry
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("n x prompts")
    assert limits.queue_refusal(0, 10 ** 6, 16) is None   # unbounded


@pytest.fixture(scope="module")
def split():
    planes = Planes(MODEL, num_kv_blocks=256, split=True, config=EngineConfig(max_queued=64),
                    plane_options=dict(http_port=0))
    yield planes
    planes.close()


def _stream(planes, **fields):
    return planes.stub.Generate(pb.GenerateRequest(**fields), timeout=120)


def test_a_cancelled_burst_never_wedges_the_front_end(split):
    """The repro of issue 29: --max-queued 64, 24 streams of n = 16 cancelled; a fresh request
    is served within seconds (the front end's view of the queue had stayed full)."""
    streams = [_stream(split, prompt=f"Burst {i} of the mill", n=16, max_tokens=400, ignore_eos=True)
               for i in range(24)]   # each call starts at once; most wait in the queue
    engine = split.engine
    deadline = time.monotonic() + 30
    while len(engine.requests) + sum(s.done() for s in streams) < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)   # samples fork, or wait for a slot
    queued = len(engine.scheduler.waiting) + sum(map(len, engine.scheduler.forks.pending.values()))
    refused = [s for s in streams if s.done()]
    assert all(s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for s in refused)
    for stream in streams:
        stream.cancel()
    t = time.monotonic()
    while True:
        try:
            ids, _, _ = completion(split.generate(prompt="It is a truth", max_tokens=4, ignore_eos=True))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t < 5, "the front end still believes the queue is full"
            time.sleep(0.05)
    assert len(ids) == 4 and time.monotonic() - t < 5
    assert refused and queued <= 64   # the bound held the rest back, counting every sample
    assert split.plane.client.scheduler.num_queued == split.engine.scheduler.num_queued == 0


def test_submissions_arriving_together_never_pass_the_bound(split):
    """Many n = 4 requests at once against a bound of 12 (a front end whose view is empty lets
    all through): the core never queues more than 12 sequences."""
    engine = split.engine
    engine.config.max_queued = 12
    engine.reconfigure(max_running=1)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], engine.scheduler.num_queued)
            time.sleep(0.0005)

    def one(i):
        try:
            split.generate(prompt=f"Together {i}", n=4, max_tokens=3, ignore_eos=True)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            codes = list(pool.map(one, range(24)))
    finally:
        stop.set()
        watcher.join()
        engine.config.max_queued = 64
        engine.reconfigure(max_running=64)
    assert "OK" in codes and "RESOURCE_EXHAUSTED" in codes and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert 0 < peak[0] <= 12, peak[0]


def test_an_http_body_counts_n_times_its_prompts(split):
    url = f"http://127.0.0.1:{split.plane.http.port}/v1/completions"
    # the body: 200 prompts x n = 16, refused before anything is tokenized or queued
    r = httpx.post(url, json={"prompt": ["It is"] * 200, "n": 16, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "--max-prompts-per-request" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": ["It is"] * 4, "n": 8, "max_tokens": 2}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and "--max-n" in error["message"] and error["param"] == "n"
    assert split.engine.scheduler.num_queued == 0
    r = httpx.post(url, json={"prompt": ["It is"] * 4, "n": 4, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    _set_bound(split, 8)   # 16 sequences can never fit: a 400, not a 429 to retry
    try:
        r = httpx.post(url, json={"prompt": ["It is"] * 4, "n": 4, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and "--max-queued" in r.json()["error"]["message"]
    finally:
        _set_bound(split, 64)


def _set_bound(planes, bound: int) -> None:
    """As Admin's UpdateConfig does: the core's bound, and its front end told."""
    planes.engine.config.max_queued = bound
    planes.call(_changed(planes.core.plane))
    deadline = time.monotonic() + 5
    while planes.plane.client.max_queued != bound and time.monotonic() < deadline:
        time.sleep(0.01)


async def _changed(plane) -> None:
    plane.changed()


def test_health_is_not_serving_while_no_work_can_be_admitted():
    """The data plane gone: the front end says NOT_SERVING (and UNAVAILABLE, not a queue
    refusal), then SERVING again once it is back."""
    planes = Planes(MODEL, num_kv_blocks=64, split=True, config=EngineConfig(outage_deadline_s=30))
    health = health_pb2_grpc.HealthStub(planes.channel)
    status = lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status  # noqa: E731

    def wait(predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.05)
        return predicate()

    try:
        planes.worker_server.stop(0).wait()
        assert wait(lambda: status() == NOT_SERVING)
        with pytest.raises(grpc.RpcError) as exc:
            planes.generate(prompt="It is", max_tokens=2)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        planes.worker_server = serve(planes.worker, planes.worker_address)   # back
        assert wait(lambda: status() == SERVING, 60)
        assert completion(planes.generate(prompt="It is", max_tokens=2, ignore_eos=True))[2]
    finally:
        planes.close()
