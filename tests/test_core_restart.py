"""Streams survive an engine core crash (controlplane/frontend/resume.py): the front end keeps its
open requests while the core is away (health NOT_SERVING, new requests refused) and submits
them again to the restarted core with the tokens their samples had, so each client's stream
goes on where it stopped with exactly the tokens and text of an undisturbed run: greedy,
seeded sampling, n = 2 with stop strings. Here the core and the front end share one event
loop (tests.harness ``split=True``); the crash drops the core's server at once, as kill -9
does (tests/test_chaos.py kills the real process)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.controlplane.core.server import CoreServer
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes

MODEL = str(default_model_dir())
REQUESTS = {
    "greedy": dict(prompt="It is a truth universally", max_tokens=120, ignore_eos=True,
                   sampling=pb.SamplingParams(temperature=0)),
    "seeded": dict(prompt="Once upon a time", max_tokens=120, ignore_eos=True,
                   sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=11)),
    "n=2 stop strings": dict(prompt="In the morning", max_tokens=120, n=2, stop=["Darcy"],
                             sampling=pb.SamplingParams(temperature=1.0, seed=5, presence_penalty=0.5)),
}


@pytest.fixture(scope="module")
def planes():
    p = Planes(MODEL, split=True)
    yield p
    p.close()


def _by_sample(responses) -> dict[int, tuple[list[int], str, int]]:
    out: dict[int, tuple[list[int], str, int]] = {}
    for r in responses:
        ids, text, _ = out.get(r.index, ([], "", 0))
        out[r.index] = (ids + list(r.token_ids), text + r.text, r.finish_reason)
    return out


def test_streams_go_on_exactly_through_a_core_crash(planes):
    expected = {name: _by_sample(planes.generate(**fields)) for name, fields in REQUESTS.items()}
    health = health_pb2_grpc.HealthStub(planes.channel)
    streams = {name: planes.stub.Generate(pb.GenerateRequest(**fields), timeout=120)
               for name, fields in REQUESTS.items()}
    firsts = {name: next(stream) for name, stream in streams.items()}   # under way
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        rests = {name: pool.submit(list, stream) for name, stream in streams.items()}
        old = planes.core
        planes.call(old.server.stop(0))   # the core's streams break
        deadline = time.monotonic() + 10
        while planes.plane.client.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:   # new requests: refused meanwhile
            planes.generate(prompt="Water", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(planes.plane.client.parked) == len(REQUESTS)
        planes.call(old.plane.stop())
        planes.core = planes.call(_restart(planes, old))
        got = {name: _by_sample([firsts[name]] + f.result(timeout=120)) for name, f in rests.items()}
    assert got == expected
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


async def _restart(planes: Planes, old: CoreServer) -> CoreServer:
    core = CoreServer(MODEL, old.plane.workers.addresses, planes.core_address)
    await core.start(ready_timeout=60)
    return core


def test_a_request_whose_client_left_while_the_core_was_away_is_not_resumed(planes):
    stream = planes.stub.Generate(pb.GenerateRequest(prompt="The river", max_tokens=400, ignore_eos=True),
                                  timeout=60)
    next(stream)
    old = planes.core
    planes.call(old.server.stop(0))
    deadline = time.monotonic() + 10
    while not planes.plane.client.parked and time.monotonic() < deadline:
        time.sleep(0.01)
    stream.cancel()
    deadline = time.monotonic() + 10
    while planes.plane.client.parked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not planes.plane.client.parked
    planes.call(old.plane.stop())
    planes.core = planes.call(_restart(planes, old))
    deadline = time.monotonic() + 10
    while not planes.plane.client.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not planes.engine.requests   # nothing was resubmitted
    assert planes.generate(prompt="Water", max_tokens=3)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_requests_fail_when_the_core_does_not_come_back_in_time(planes):
    client = planes.plane.client
    client.parked.deadline_s = 0.5
    try:
        stream = planes.stub.Generate(pb.GenerateRequest(prompt="The river", max_tokens=400,
                                                         ignore_eos=True), timeout=60)
        next(stream)
        old = planes.core
        planes.call(old.server.stop(0))
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not come back within 0.5s" in err.value.details()
        planes.call(old.plane.stop())
        planes.core = planes.call(_restart(planes, old))
        deadline = time.monotonic() + 10
        while not client.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planes.generate(prompt="Water", max_tokens=3)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        client.parked.deadline_s = 60.0
