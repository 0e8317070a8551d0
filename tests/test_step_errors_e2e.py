"""Steps that raise in a real data plane (dataplane/server.py answers them with
``StepResult.error``, the stream stays open) and what the control plane makes of it
(controlplane/engine/step_failures.py), both planes in this process over gRPC (tests.harness) with
failpoints (common/failpoints.py) set here: a request whose sampling raises fails alone with
INTERNAL while the others get exactly their undisturbed tokens; a step that raises once fails
no one; the worker's metrics count the raised steps."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from headrace.common import failpoints
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion

MODEL = str(default_model_dir())


@pytest.fixture(scope="module")
def planes():
    p = Planes(MODEL)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def no_failpoints():
    yield
    failpoints.configure(None)


def _run(planes, i: int, seed: int | None = None):
    sampling = pb.SamplingParams(temperature=0) if seed is None else pb.SamplingParams(temperature=0.8, seed=seed)
    return completion(planes.generate(prompt=f"It is a truth {i}", max_tokens=40, ignore_eos=True,
                                      sampling=sampling))


def _errors(planes) -> float:
    return planes.worker_server.worker_service.metrics.errors.labels("INTERNAL")._value.get()


def test_a_request_whose_sampling_raises_fails_alone(planes):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda i: _run(planes, i), range(4)))
    failpoints.configure("dataplane.sampler=raise(IndexError)@seed=666")
    before = _errors(planes)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        others = [pool.submit(_run, planes, i) for i in range(4)]
        with pytest.raises(grpc.RpcError) as err:
            _run(planes, 99, seed=666)
        got = [f.result() for f in others]
    assert err.value.code() == grpc.StatusCode.INTERNAL and "IndexError" in err.value.details()
    assert got == expected
    assert _errors(planes) > before and planes.engine.healthy and planes.engine.faults.culprits >= 1
    total = planes.engine.scheduler.blocks.num_blocks
    assert planes.wait_for_free_blocks(total) == total


def test_a_step_that_raises_once_fails_no_one(planes):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda i: _run(planes, i), range(4)))
    culprits = planes.engine.faults.culprits
    failpoints.configure("dataplane.step=raise(RuntimeError)@after=6@times=1")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: _run(planes, i), range(4)))
    assert failpoints.ACTIVE["dataplane.step"].acted == 1
    assert got == expected and planes.engine.faults.culprits == culprits and planes.engine.healthy
