"""Chaos tests (issue 52): a real ``headrace serve`` tree (the embedded model on the CPU, two API
front ends) with 8 greedy streams in flight while something goes wrong (tests/chaos.py), and
nothing is lost: every stream ends with all its tokens, the same as undisturbed, or with an
explicit status where nothing could save it (the clients of a front end killed under them).

1. a poisoned request (its sampling raises: the ``dataplane.sampler`` failpoint by its seed):
   INTERNAL within 5 s, the others finish, the log grows little, the next request is served;
2. streams abandoned after their first token: no request, block or memory left behind;
3-5. SIGSTOP of the data plane (NOT_SERVING within seconds), of the engine core, of a front end;
6-8. kill -9 of the data plane, of the engine core (the streams go on through the restart), of a
   front end;
9. a data plane stopped for good: the core's watchdog finds it hung and serve restarts it;
10. Ctrl-C with HTTP streams open: each ends with an error event and [DONE] after the drain
   timeout, the tree is gone soon after, no traceback.
And the logs of it all: no line over 8 KB, none without ``role``, no prompt token ids.
``bench/chaos.py`` runs the same at the issue's sizes (200 tokens, a 20 s stop)."""

from __future__ import annotations

import grpc
import pytest

from tests import chaos
from tests.served import Served, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
N, TOKENS = 8, 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    http = free_port()
    server = Served(tmp_path_factory.mktemp("chaos") / "serve.log", api_server_count=2,
                    extra=chaos.serve_argv_extra(http, floor_s=1.0), env={"HEADRACE_FAILPOINTS": chaos.FAILPOINTS})
    server.http_port = http
    try:
        server.wait_serving()
        server.expected = chaos.reference(server, N, TOKENS)
        yield server
    finally:
        server.close()


def _all_same(out: dict) -> None:
    assert out["errors"] == [] and out["hung"] == 0, out
    assert out["completed"] == out["same_tokens"] == out["streams"], out


def test_a_poisoned_request_fails_alone_and_fast(served):
    out = chaos.poisoned(served, served.expected, TOKENS)
    assert out["poisoned_error"][0] == "INTERNAL" and "IndexError" in out["poisoned_error"][1], out
    assert out["poisoned_failed_after_s"] < 5, out
    _all_same(out)
    assert out["next_request_ok"], out
    assert out["log_growth_bytes"] < 200_000, out


def test_abandoned_streams_leave_nothing_behind(served):
    out = chaos.abandoned(served, 100, tokens=TOKENS)
    assert out["in_flight_after"] == 0 and out["kv_usage_after"] == 0, out
    assert max(out["rss_growth_mb"].values()) < 64, out


def test_sigstop_of_the_data_plane_is_noticed_in_seconds(served):
    out = chaos.stop(served, "dataplane", served.expected, TOKENS, seconds=6)
    assert out["not_serving_after_s"] is not None and out["not_serving_after_s"] < 5, out
    assert out["ready_503_after_s"] is not None, out
    _all_same(out)


@pytest.mark.parametrize("role", ["core", "frontend 0"])
def test_sigstop_of_a_control_plane_process_loses_nothing(served, role):
    _all_same(chaos.stop(served, role, served.expected, TOKENS, seconds=2))


@pytest.mark.parametrize("role", ["dataplane", "core"])
def test_kill_9_loses_no_stream(served, role):
    out = chaos.kill(served, role, served.expected, TOKENS)
    _all_same(out)


def test_kill_9_of_the_core_keeps_seeded_streams_exact(served):
    expected = chaos.reference(served, N, TOKENS, seeded=True)
    _all_same(chaos.kill(served, "core", expected, TOKENS, seeded=True))


def test_kill_9_of_a_front_end_fails_only_its_streams_explicitly(served):
    out = chaos.kill(served, "frontend 0", served.expected, TOKENS)
    assert out["hung"] == 0 and out["victim_errors"] == ["UNAVAILABLE"] * (N // 2), out
    assert out["others_same"] == N // 2, out


def test_the_logs_are_safe_to_keep(served):
    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        ids = [list(stub.Tokenize(pb.TokenizeRequest(text=p), timeout=10).token_ids)
               for p in chaos.prompts(N)]
    out = chaos.check_logs(served.log.name, ids)
    assert out["over_8kb"] == 0 and out["without_role"] == 0 and out["prompt_ids_found"] == 0, out


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """A server whose watchdog counts a data plane hung after 3 s, and drains for 3 s."""
    http = free_port()
    server = Served(tmp_path_factory.mktemp("fragile") / "serve.log", api_server_count=1,
                    extra=chaos.serve_argv_extra(http, floor_s=1.0, hang_s=3.0, drain_s=3.0))
    server.http_port = http
    try:
        server.wait_serving()
        yield server
    finally:
        server.close()


def test_a_hung_data_plane_is_killed_and_restarted_and_the_streams_resume(fragile, served):
    import os
    import signal

    expected = served.expected
    with grpc.insecure_channel(fragile.address) as channel:
        streams = chaos.run_streams(channel, [chaos.greedy(p, TOKENS) for p in chaos.prompts(N)])
        chaos.wait_under_way(streams)
        os.kill(fragile.role_pids()["dataplane"], signal.SIGSTOP)   # never continued
        chaos.join(streams, 120)
    _all_same(chaos._summary(streams, expected))
    assert fragile.metric("headrace:dataplane_restarts_total", cause="hung") == 1


def test_ctrl_c_ends_every_http_stream_with_a_last_event(fragile):
    out = chaos.ctrl_c(fragile, N, tokens=900, drain_timeout=3.0)
    assert out["done_events"] == out["error_events"] == N and out["transport_errors"] == 0, out
    assert out["last_stream_end_s"] <= 3.0, out   # within the drain timeout
    assert out["tree_gone_s"] is not None and out["tree_gone_s"] < 3.0 + 3.0, out
    assert out["tracebacks_after_signal"] == 0, out
