"""The control plane as processes (issue 18): `headrace serve --api-server-count 2` runs one
engine core and two API front ends on one port. Several front ends stream concurrently with
exact token order; Admin reaches the core from every front end; a slow reader gets its tokens
coalesced without stalling anyone; an abort frees its blocks; /metrics is one, summed over the
processes; kill -9 of a front end mid-stream aborts its requests only and it comes back; while
the core is down the front ends answer UNAVAILABLE (health NOT_SERVING) and recover with it;
the core link is private (0600 socket, core secret); TTFT/ITL/e2e are observed by the front
ends only; a model reload through one front end is served by every one.

One server for the module (start-up is most of the cost); the destructive tests run last."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import stat
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.served import Served

PROMPTS = ["The river", "Once upon a time", "In the morning the", "A small boat", "Water runs",
           "The mill wheel"]
GREEDY = pb.SamplingParams(temperature=0.0)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("served") / "serve.log", api_server_count=2,
                    extra=("--admin-insecure-loopback", "--model-root", str(tmp_path_factory.getbasetemp())))
    try:
        server.wait_serving()
        yield server
    finally:
        server.close()


def _generate(channel, prompt: str, max_tokens: int = 16, **fields):
    stub = pb_grpc.InferenceStub(channel)
    return list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY,
                                                 **fields), timeout=60))


def _ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def _idle(served: Served) -> bool:
    return (served.metric("headrace:kv_cache_usage_perc") == 0.0
            and served.metric("headrace:num_requests_in_flight") == 0.0)


def test_processes_name_their_roles_and_import_no_torch(served):
    roles = served.role_pids()
    assert {"core", "frontend 0", "frontend 1", "dataplane"} <= set(roles), roles
    for role in ("core", "frontend 0", "frontend 1"):
        with open(f"/proc/{roles[role]}/maps") as maps:
            assert "libtorch" not in maps.read(), f"{role} loaded torch"
    log = served.log_tail(10**7)
    for field in ('"role": "core"', '"role": "frontend"', '"frontend": 1', '"role": "dataplane"'):
        assert field in log, field


def test_the_core_link_is_private_and_needs_the_core_secret(served):
    roles = served.role_pids()
    argv = psutil.Process(roles["core"]).cmdline()
    address = argv[argv.index("--core-address") + 1]
    assert address.startswith("unix:")
    path = address[5:]
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    envs = {role: psutil.Process(pid).environ() for role, pid in roles.items()}
    secret = envs["core"]["HEADRACE_CORE_SECRET"]
    assert len(secret) >= 32 and envs["frontend 0"]["HEADRACE_CORE_SECRET"] == secret
    assert "HEADRACE_CORE_SECRET" not in envs["dataplane"]
    for pid in roles.values():
        assert secret not in " ".join(psutil.Process(pid).cmdline())
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        apb_grpc.AdminStub(channel).GetConfig(apb.GetConfigRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED   # the socket alone is not enough


def test_front_ends_stream_concurrently_in_exact_order(served):
    channels = [served.channel_to(0), served.channel_to(1)]
    reference = {p: _ids(_generate(channels[0], p)) for p in PROMPTS}   # one at a time
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        jobs = {pool.submit(_generate, channels[i % 2], p): (i, p)
                for i, p in enumerate(PROMPTS * 2)}
        for job in concurrent.futures.as_completed(jobs):
            responses = job.result()
            _, prompt = jobs[job]
            assert _ids(responses) == reference[prompt], prompt
            assert len(responses) > 1 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert responses[-1].usage.completion_tokens == 16
            assert all(len(r.token_ids) >= 1 for r in responses)


def test_stop_string_is_matched_at_the_front_end(served):
    channel = served.channel_to(1)
    full = _generate(channel, "Once upon a time", max_tokens=24)
    text = "".join(r.text for r in full)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = _generate(channel, "Once upon a time", max_tokens=24, stop=[stop])
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP_STRING
    assert "".join(r.text for r in cut) == text[:text.index(stop)]
    served.wait_for(lambda: _idle(served), 10, "blocks freed after the stop string")


def test_admin_reaches_the_core_from_every_front_end(served):
    admins = [apb_grpc.AdminStub(served.channel_to(i)) for i in range(2)]
    configs = [a.GetConfig(apb.GetConfigRequest(), timeout=10) for a in admins]
    assert configs[0].num_kv_blocks == configs[1].num_kv_blocks > 0 and configs[0].ready
    changed = admins[0].UpdateConfig(apb.UpdateConfigRequest(max_queued=77), timeout=10)
    assert changed.max_queued == 77
    assert admins[1].GetConfig(apb.GetConfigRequest(), timeout=10).max_queued == 77
    admins[1].UpdateConfig(apb.UpdateConfigRequest(max_queued=0), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        admins[0].UpdateConfig(apb.UpdateConfigRequest(policy="nonsense"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_slow_reader_gets_coalesced_tokens_and_stalls_no_one(served):
    # a small HTTP/2 window: the front end's writes wait on this client as soon as it stops reading
    slow_channel = served.channel_to(0, options=[("grpc.http2.lookahead_bytes", 256),
                                                 ("grpc.http2.bdp_probe", 0)])
    fast_channel = served.channel_to(1)
    reference = _ids(_generate(fast_channel, "A small boat", max_tokens=200))
    stream = pb_grpc.InferenceStub(slow_channel).Generate(
        pb.GenerateRequest(prompt="A small boat", max_tokens=200, sampling=GREEDY), timeout=60)
    first = next(stream)
    started = time.monotonic()
    others = [_generate(fast_channel, p, max_tokens=8) for p in PROMPTS[:3]]   # meanwhile
    assert time.monotonic() - started < 20 and all(o[-1].finish_reason for o in others)
    time.sleep(1.0)   # the slow client reads nothing while its tokens are generated
    rest = list(stream)
    assert _ids([first] + rest) == reference
    assert len(rest) < 150, "a slow reader's tokens come coalesced"


def test_cancelled_stream_frees_its_blocks(served):
    channel = served.channel_to(1)
    stream = pb_grpc.InferenceStub(channel).Generate(
        pb.GenerateRequest(prompt="The river " * 40, max_tokens=900, sampling=GREEDY), timeout=60)
    next(stream)
    assert served.metric("headrace:kv_cache_usage_perc") > 0
    stream.cancel()
    served.wait_for(lambda: _idle(served), 10, "blocks freed after the cancel")


LATENCIES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
             "e2e_request_latency_seconds", "request_queue_time_seconds")


def test_one_metrics_endpoint_sums_every_process(served):
    before = served.metric("headrace:api_requests_total", api="grpc", method="Generate")
    histograms = {name: served.metric(f"headrace:{name}_count") for name in LATENCIES}
    per_process = served.histogram_counts(LATENCIES)
    streams = [_generate(served.channel_to(i), "Water runs", max_tokens=4) for i in (0, 1, 1)]
    after = served.metric("headrace:api_requests_total", api="grpc", method="Generate")
    assert after - before == 3   # counted by two front-end processes, served by the core
    metrics = served.metrics()
    assert ("headrace:num_kv_blocks", ()) in metrics
    # the client-facing latencies: once per request (per token after each stream's first
    # response), observed by the front ends, summed into the core's /metrics
    gaps = sum(len(_ids(r)) - len(next(m for m in r if m.token_ids).token_ids) for r in streams)
    moved = {name: metrics[(f"headrace:{name}_count", ())] - histograms[name] for name in LATENCIES}
    assert moved == {"time_to_first_token_seconds": 3, "inter_token_latency_seconds": gaps,
                     "e2e_request_latency_seconds": 3, "request_queue_time_seconds": 3}
    assert gaps >= 3
    now = served.histogram_counts(LATENCIES)
    by_role = {role: {name: now[role][name] - per_process.get(role, {}).get(name, 0.0)
                      for name in LATENCIES} for role in now}
    assert by_role["frontend 0"]["time_to_first_token_seconds"] == 1
    assert by_role["frontend 1"]["time_to_first_token_seconds"] == 2
    assert by_role["frontend 0"]["e2e_request_latency_seconds"] == 1
    assert by_role["frontend 1"]["e2e_request_latency_seconds"] == 2
    assert by_role["frontend 0"]["inter_token_latency_seconds"] + \
        by_role["frontend 1"]["inter_token_latency_seconds"] == gaps
    assert by_role["core"] == {"time_to_first_token_seconds": 0, "inter_token_latency_seconds": 0,
                               "e2e_request_latency_seconds": 0, "request_queue_time_seconds": 3}


def test_reload_through_one_front_end_serves_the_new_model_on_every_one(served, tmp_path_factory):
    """Admin ReloadModel through front end 0 while front end 1 streams: its request ends
    ABORTED after the drain timeout, its health goes SERVING -> NOT_SERVING -> SERVING, and it
    then serves the new model (its info, its tokens); reloading back through front end 1 gives
    front end 0 the first model's exact tokens again."""
    from tests.checkpoints import make_checkpoint

    other = make_checkpoint(tmp_path_factory.mktemp("other-model"), "qwen2", heads=2, kv_heads=2,
                            head_dim=64, tie=True, seed=1)
    first, second = served.channel_to(0), served.channel_to(1)
    original = apb_grpc.AdminStub(first).GetConfig(apb.GetConfigRequest(), timeout=10).model
    before = _ids(_generate(second, "The river", max_tokens=8, ignore_eos=True))
    statuses: list[int] = []
    watch = health_pb2_grpc.HealthStub(second).Watch(health_pb2.HealthCheckRequest(), timeout=180)

    def collect():
        try:
            for answer in watch:
                statuses.append(answer.status)
        except grpc.RpcError:
            pass   # cancelled at the end

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    try:
        served.wait_for(lambda: statuses, 10, "the health watch")
        inflight = pb_grpc.InferenceStub(second).Generate(pb.GenerateRequest(
            prompt="The river " * 10, max_tokens=900, ignore_eos=True, sampling=GREEDY), timeout=120)
        next(inflight)
        resp = apb_grpc.AdminStub(first).ReloadModel(
            apb.ReloadModelRequest(model=str(other), drain_timeout_s=0.3), timeout=180)
        assert resp.model == str(other) and resp.model_name == other.name and resp.aborted == 1
        assert list(inflight)[-1].finish_reason == pb.FINISH_REASON_ABORTED
        served.wait_for(lambda: statuses[-1] == SERVING and NOT_SERVING in statuses, 30,
                        "front end 1 SERVING again after NOT_SERVING")
        assert statuses[0] == SERVING
        info = pb_grpc.InferenceStub(second).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.architecture == "Qwen2ForCausalLM" and info.model_name == other.name
        after = _generate(second, "The river", max_tokens=8, ignore_eos=True)
        assert after[-1].finish_reason == pb.FINISH_REASON_LENGTH and _ids(after) != before
        # and back, through the other front end
        resp = apb_grpc.AdminStub(second).ReloadModel(
            apb.ReloadModelRequest(model=original, drain_timeout_s=5), timeout=180)
        assert resp.model == original and resp.aborted == 0
        served.wait_for(lambda: served.health(first) == SERVING, 30, "front end 0 SERVING")
        assert _ids(_generate(first, "The river", max_tokens=8, ignore_eos=True)) == before
    finally:
        watch.cancel()
        collector.join(5)


def test_kill_9_of_a_front_end_mid_stream(served):
    victim_channel, other_channel = served.channel_to(0), served.channel_to(1)
    victim = served.role_pids()["frontend 0"]
    doomed = pb_grpc.InferenceStub(victim_channel).Generate(
        pb.GenerateRequest(prompt="The river " * 40, max_tokens=900, sampling=GREEDY), timeout=60)
    next(doomed)
    survivor = pb_grpc.InferenceStub(other_channel).Generate(
        pb.GenerateRequest(prompt="Once upon a time", max_tokens=64, sampling=GREEDY), timeout=60)
    first = next(survivor)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(doomed)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(survivor)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(_ids([first] + rest)) == 64
    served.wait_for(lambda: _idle(served), 15, "the killed front end's blocks freed")
    served.wait_for(lambda: served.role_pids().get("frontend 0") not in (None, victim), 30,
                    "front end 0 restarted")
    served.wait_for(lambda: _generate(served.channel_to(0), "Water runs", max_tokens=4), 30,
                    "the restarted front end serving")


def test_front_ends_stay_up_while_the_core_restarts(served):
    """A front end outlives its core: while the core restarts, each request either waits and
    is served by the restarted core (``headrace.controlplane.frontend.resume``) or, arriving
    while the core is known to be away, fails UNAVAILABLE; nothing else, and the same front-end
    process serves again afterwards."""
    channel = served.channel_to(1)
    frontend = served.role_pids()["frontend 1"]
    core = served.role_pids()["core"]
    os.kill(core, signal.SIGKILL)
    outcomes = set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            _generate(channel, "Water runs", max_tokens=2)
            outcomes.add("served")
        except grpc.RpcError as exc:
            outcomes.add(exc.code().name)
    assert outcomes <= {"served", "UNAVAILABLE"}, outcomes
    served.wait_for(lambda: served.role_pids().get("core", core) != core, 30, "a new core")
    served.wait_for(lambda: served.health(channel) == health_pb2.HealthCheckResponse.SERVING, 60,
                    "SERVING again with the restarted core")
    assert served.role_pids()["frontend 1"] == frontend, "the front end stayed up"
    assert _generate(channel, "Water runs", max_tokens=4)[-1].finish_reason == pb.FINISH_REASON_LENGTH
