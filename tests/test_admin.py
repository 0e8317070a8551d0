"""The Admin service and health: live configuration (a policy change takes effect on the next
step), queue bound, drain (NOT_SERVING, UNAVAILABLE to new requests, in-flight ones finish),
resume, model reload between two checkpoints with in-flight requests aborted cleanly, and
access control."""

from __future__ import annotations

import concurrent.futures
import pathlib
import shutil
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.controlplane.admin import is_local_peer
from headrace.controlplane.engine.loop import EngineConfig
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    a = make_checkpoint(tmp_path_factory.mktemp("model-a"), "llama", heads=4, kv_heads=2, head_dim=32)
    b = make_checkpoint(tmp_path_factory.mktemp("model-b"), "qwen2", heads=2, kv_heads=2, head_dim=64,
                        tie=True, seed=1)
    return a, b


@pytest.fixture(scope="module")
def planes(checkpoints):
    p = Planes(checkpoints[0], num_kv_blocks=64, config=EngineConfig(max_running=1),
               plane_options={"admin_insecure_loopback": True})
    p.admin = apb_grpc.AdminStub(p.channel)
    p.health = health_pb2_grpc.HealthStub(p.channel)
    yield p
    p.close()


def _status(planes, service="") -> int:
    return planes.health.Check(health_pb2.HealthCheckRequest(service=service)).status


def _wait(predicate, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_get_config_reports_the_live_configuration(planes):
    cfg = planes.admin.GetConfig(apb.GetConfigRequest())
    assert cfg.policy.name == "fifo" and not cfg.policy.HasField("aging_rate")
    assert cfg.max_running == 1 and cfg.max_batched_tokens == 2048 and cfg.max_queued == 4   # 4 x max_running
    assert cfg.num_kv_blocks == 64 and cfg.kv_block_size == 16 and cfg.max_model_len == 256
    assert cfg.ready and not cfg.draining
    assert cfg.worker_max_running == planes.worker.opts.max_num_seqs
    assert cfg.model == str(planes.plane.model_dir) and cfg.workers == [planes.worker_address]
    for service in ("", "headrace.v1.Inference", "headrace.v1.Admin"):
        assert _status(planes, service) == SERVING


def test_policy_change_takes_effect_on_the_next_step(planes):
    """One sequence runs at a time. Three requests queue behind a long one in arrival order
    with priorities 5, 1, 0; switching fifo -> priority while they wait serves them 0, 1, 5
    (the order the engine finishes them in: the clients' threads may see their ends later)."""
    telemetry = planes.engine.telemetry
    order, results = [], {}

    def request_done(request):
        order.append(request.request_id)
        type(telemetry).request_done(telemetry, request)

    telemetry.request_done = request_done
    try:
        def run(name, priority, max_tokens):
            results[name] = planes.generate(prompt_token_ids=pb.TokenIds(ids=[3, 4, 5]), max_tokens=max_tokens,
                                            ignore_eos=True, priority=priority, request_id=name)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(run, "long", 0, 200)]
            assert _wait(lambda: len(planes.engine.scheduler.running) == 1)
            for name, prio in (("p5", 5), ("p1", 1), ("p0", 0)):
                jobs.append(pool.submit(run, name, prio, 3))
                assert _wait(lambda n=name: any(s.request_id == n for s in planes.engine.scheduler.waiting))
            assert not order, "the long request still runs while the policy changes"
            cfg = planes.admin.UpdateConfig(apb.UpdateConfigRequest(policy="priority"))
            assert cfg.policy.name == "priority"
            assert planes.engine.scheduler.policy.name == "priority"   # what the next step uses
            [j.result() for j in jobs]
        assert order == ["long", "p0", "p1", "p5"]
        assert all(completion(r)[2] == pb.FINISH_REASON_LENGTH for r in results.values())
    finally:
        del telemetry.request_done
        planes.admin.UpdateConfig(apb.UpdateConfigRequest(policy="fifo"))


def test_max_running_and_token_budget_change_live(planes):
    try:
        cfg = planes.admin.UpdateConfig(apb.UpdateConfigRequest(max_running=3, max_batched_tokens=8))
        assert (cfg.max_running, cfg.max_batched_tokens) == (3, 8)
        peak, stop = [0, 0], threading.Event()

        def watch():
            while not stop.is_set():
                sched = planes.engine.scheduler
                peak[0] = max(peak[0], len(sched.running))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda i: planes.generate(prompt_token_ids=pb.TokenIds(ids=[6 + i] * 20),
                                                         max_tokens=30, ignore_eos=True), range(4)))
        stop.set()
        watcher.join()
        assert peak[0] == 3
        assert all(len(completion(r)[0]) == 30 for r in rs)
    finally:
        planes.admin.UpdateConfig(apb.UpdateConfigRequest(max_running=1, max_batched_tokens=2048))


@pytest.mark.parametrize("bad", [
    apb.UpdateConfigRequest(policy="lottery"),
    apb.UpdateConfigRequest(max_running=0),
    apb.UpdateConfigRequest(max_running=100000),
    apb.UpdateConfigRequest(max_batched_tokens=10**6),
    apb.UpdateConfigRequest(max_queue_delay_s=-1),
])
def test_bad_updates_are_invalid_argument(planes, bad):
    with pytest.raises(grpc.RpcError) as info:
        planes.admin.UpdateConfig(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    cfg = planes.admin.GetConfig(apb.GetConfigRequest())
    assert cfg.policy.name == "fifo" and cfg.max_running == 1


def test_policy_aging_and_queue_delay_are_set_and_cleared(planes):
    cfg = planes.admin.UpdateConfig(apb.UpdateConfigRequest(policy="sjf", aging_rate=5, max_queue_delay_s=2))
    assert (cfg.policy.name, cfg.policy.aging_rate, cfg.policy.max_queue_delay_s) == ("sjf", 5, 2)
    cfg = planes.admin.UpdateConfig(apb.UpdateConfigRequest(policy="fifo", aging_rate=-1, max_queue_delay_s=0))
    assert cfg.policy.name == "fifo"
    assert not cfg.policy.HasField("aging_rate") and not cfg.policy.HasField("max_queue_delay_s")


def test_queue_bound_is_resource_exhausted(planes):
    try:
        planes.admin.UpdateConfig(apb.UpdateConfigRequest(max_queued=1))
        long = planes.stub.Generate(pb.GenerateRequest(prompt="the", max_tokens=150, ignore_eos=True))
        next(long)   # running (max_running is 1)
        queued = planes.stub.Generate(pb.GenerateRequest(prompt="fox", max_tokens=2, ignore_eos=True))
        assert _wait(lambda: len(planes.engine.scheduler.waiting) == 1)
        with pytest.raises(grpc.RpcError) as info:
            planes.generate(prompt="dog", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        long.cancel()
        assert completion(list(queued))[2] == pb.FINISH_REASON_LENGTH
    finally:
        planes.admin.UpdateConfig(apb.UpdateConfigRequest(max_queued=0))


def test_drain_refuses_new_requests_while_in_flight_ones_finish(planes):
    in_flight = planes.stub.Generate(pb.GenerateRequest(prompt="the quick", max_tokens=60,
                                                        ignore_eos=True, sampling=GREEDY))
    first = next(in_flight)
    resp = planes.admin.Drain(apb.DrainRequest(timeout_s=0))
    assert not resp.drained and resp.in_flight == 1 and resp.aborted == 0
    assert _status(planes) == NOT_SERVING and _status(planes, "headrace.v1.Inference") == NOT_SERVING
    assert _status(planes, "headrace.v1.Admin") == SERVING
    with pytest.raises(grpc.RpcError) as info:
        planes.generate(prompt="hello", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
    assert planes.admin.GetConfig(apb.GetConfigRequest()).draining
    rest = list(in_flight)   # the in-flight request streams to its end
    ids, _, reason = completion([first] + rest)
    assert reason == pb.FINISH_REASON_LENGTH and len(ids) == 60
    assert planes.admin.Drain(apb.DrainRequest(timeout_s=10)).drained
    assert _status(planes) == NOT_SERVING
    cfg = planes.admin.Resume(apb.ResumeRequest())
    assert cfg.ready and not cfg.draining and _status(planes) == SERVING
    assert completion(planes.generate(prompt="hello", max_tokens=2, ignore_eos=True))[2] == \
        pb.FINISH_REASON_LENGTH


def test_drain_can_abort_what_is_left_cleanly(planes):
    start_free = planes.free_blocks
    call = planes.stub.Generate(pb.GenerateRequest(prompt="the quick", max_tokens=200, ignore_eos=True))
    first = next(call)
    try:
        resp = planes.admin.Drain(apb.DrainRequest(timeout_s=0.05, abort_remaining=True))
        assert resp.drained and resp.aborted == 1 and resp.in_flight == 0
        rest = list(call)   # ends with OK status and a last ABORTED message with usage
        ids, _, reason = completion([first] + rest)
        assert reason == pb.FINISH_REASON_ABORTED and 0 < len(ids) < 200
        assert rest[-1].usage.completion_tokens == len(ids)
        assert planes.wait_for_free_blocks(start_free) == start_free
    finally:
        planes.admin.Resume(apb.ResumeRequest())


def test_reload_another_model_and_back(planes, checkpoints):
    a, b = checkpoints
    req = dict(prompt="the quick brown", max_tokens=8, ignore_eos=True, sampling=GREEDY)
    before = completion(planes.generate(**req))
    info_a = planes.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info_a.architecture == "LlamaForCausalLM"
    # a request in flight during the reload ends cleanly with ABORTED after the drain timeout
    call = planes.stub.Generate(pb.GenerateRequest(prompt="the", max_tokens=200, ignore_eos=True))
    next(call)
    resp = planes.admin.ReloadModel(apb.ReloadModelRequest(model=str(b), drain_timeout_s=0.05))
    assert resp.aborted == 1 and resp.model == str(b) and resp.model_name == b.name
    assert completion(list(call))[2] == pb.FINISH_REASON_ABORTED
    info_b = planes.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info_b.architecture == "Qwen2ForCausalLM" and info_b.model_name == b.name
    assert _status(planes) == SERVING
    after_b = completion(planes.generate(**req))
    assert after_b[2] == pb.FINISH_REASON_LENGTH and after_b[0] != before[0]
    cfg = planes.admin.GetConfig(apb.GetConfigRequest())
    assert cfg.model == str(b) and cfg.max_running == 1 and cfg.num_kv_blocks == 64
    # and back: the same greedy completion as before the first reload
    resp = planes.admin.ReloadModel(apb.ReloadModelRequest(model=str(a), drain_timeout_s=5))
    assert resp.aborted == 0 and resp.model_name == a.name
    assert completion(planes.generate(**req)) == before
    assert planes.free_blocks == 64


def test_reload_of_a_bad_directory_keeps_serving(planes, tmp_path):
    with pytest.raises(grpc.RpcError) as info:
        planes.admin.ReloadModel(apb.ReloadModelRequest(model=str(tmp_path / "missing")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _status(planes) == SERVING
    # a directory the tokenizer accepts but the data plane cannot load: the old model is put back
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pathlib.Path(planes.plane.model_dir) / f, broken / f)
    bad_template = tmp_path / "bad-template"   # refused before anything is drained
    shutil.copytree(broken, bad_template)
    (bad_template / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(grpc.RpcError) as info:
        planes.admin.ReloadModel(apb.ReloadModelRequest(model=str(bad_template)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in info.value.details() and _status(planes) == SERVING
    with pytest.raises(grpc.RpcError) as info:
        planes.admin.ReloadModel(apb.ReloadModelRequest(model=str(broken)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _wait(lambda: _status(planes) == SERVING)
    assert completion(planes.generate(prompt="hi", max_tokens=2, ignore_eos=True))[2] == \
        pb.FINISH_REASON_LENGTH


def test_admin_token(planes):
    planes.plane.admin.token = "s3cret"
    try:
        with pytest.raises(grpc.RpcError) as info:
            planes.admin.GetConfig(apb.GetConfigRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            planes.admin.Drain(apb.DrainRequest(), metadata=[("authorization", "Bearer wrong")])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _status(planes) == SERVING
        cfg = planes.admin.GetConfig(apb.GetConfigRequest(), metadata=[("authorization", "Bearer s3cret")])
        assert cfg.ready
        errors = planes.plane.metrics.registry.get_sample_value(
            "headrace:request_errors_total", {"method": "Drain", "code": "UNAUTHENTICATED", "api": "grpc"})
        assert errors == 1
    finally:
        planes.plane.admin.token = None


def test_reload_is_limited_to_the_model_roots_and_reveals_nothing_outside(planes, tmp_path):
    """Outside the roots (default: the served model's parent directory, the hub cache), an
    existing directory and a missing one get the same refusal, before anything is read."""
    answers = []
    for path in ("/etc", "/etc/no-such-dir-xyz", str(tmp_path / ".." / ".." / ".." / "etc")):
        with pytest.raises(grpc.RpcError) as info:
            planes.admin.ReloadModel(apb.ReloadModelRequest(model=path))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        answers.append(info.value.details().replace(repr(path), "PATH"))
    assert len(set(answers)) == 1 and "--model-root" in answers[0]
    assert _status(planes) == SERVING


def test_admin_without_a_token_is_disabled_unless_opted_in(checkpoints):
    """No admin token and no --admin-insecure-loopback: disabled, even for a loopback caller
    of a loopback server (a local proxy would make every caller look local)."""
    p = Planes(checkpoints[0], num_kv_blocks=16)
    try:
        with pytest.raises(grpc.RpcError) as info:
            apb_grpc.AdminStub(p.channel).GetConfig(apb.GetConfigRequest())
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "disabled" in info.value.details() and "--admin-token" in info.value.details()
    finally:
        p.close()


def test_only_local_callers_without_a_token():
    assert is_local_peer("ipv4:127.0.0.1:5555") and is_local_peer("ipv6:[::1]:5555")
    assert is_local_peer("unix:/tmp/x.sock") and is_local_peer("ipv6:[::ffff:127.0.0.1]:1")
    assert not is_local_peer("ipv4:10.0.0.7:5555") and not is_local_peer("ipv6:[fe80::1]:5555")
    assert not is_local_peer("")
