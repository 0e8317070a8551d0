"""The HTTP front end over raw HTTP (httpx): SSE framing, a client that leaves mid-stream (its
request is aborted and its KV blocks freed), body bounds, error objects, health/readiness,
tokenize/detokenize, the caller's traceparent in the request's logs, and sampling defaults
from generation_config.json."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from headrace.dataplane.default_model import default_model_dir
from tests.harness import Planes


@pytest.fixture(scope="module")
def planes():
    planes = Planes(default_model_dir(), num_kv_blocks=256, plane_options={"http_port": 0})
    yield planes
    planes.close()


@pytest.fixture(scope="module")
def http(planes):
    with httpx.Client(base_url=f"http://127.0.0.1:{planes.plane.http.port}", timeout=60) as client:
        yield client


def test_sse_framing(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert len({c["id"] for c in chunks}) == 1


def test_client_leaving_mid_stream_frees_its_blocks(planes, http):
    free = planes.free_blocks
    body = {"model": "tiny", "prompt": "It is a truth universally acknowledged", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)
        assert planes.free_blocks < free and len(planes.engine.requests) == 1
    assert planes.wait_for_free_blocks(free) == free
    deadline = time.monotonic() + 10
    while planes.engine.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not planes.engine.requests
    cancelled = planes.plane.metrics.registry.get_sample_value(
        "headrace:request_errors_total", {"method": "Completions", "code": "CANCELLED", "api": "http"})
    assert cancelled == 1


def test_client_leaving_before_a_whole_response_frees_its_blocks(planes):
    free = planes.free_blocks
    body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{planes.plane.http.port}/v1/completions", json=body, timeout=0.5)
    assert planes.wait_for_free_blocks(free) == free and not planes.engine.requests


def test_errors_are_openai_objects_without_traces(planes, http):
    cases = [
        (http.post("/v1/completions", content=b"{not json"), 400),
        (http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 400),
        (http.post("/v1/completions", json={"model": "tiny"}), 400),
        (http.post("/v1/completions", content=b"x" * (33 << 20)), 413),
        (http.get("/v1/nothing"), 404),
        (http.post("/v1/completions", json={"prompt": "x", "echo": True}), 400),
        (http.post("/detokenize", json={"tokens": [10**6]}), 400),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    assert cases[2][0].json()["error"]["param"] == "prompt"
    assert cases[1][0].json()["error"]["param"] == "max_tokens"


def test_health_ready_tokenize_detokenize(planes, http):
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200
    planes.engine.draining = True
    try:
        assert http.get("/health").status_code == 200
        ready = http.get("/ready")
        assert ready.status_code == 503 and "draining" in ready.json()["error"]["message"]
    finally:
        planes.engine.draining = False
    tok = http.post("/tokenize", json={"prompt": "Mr Darcy"}).json()
    assert tok["tokens"] == planes.plane.tokenizer.encode("Mr Darcy") and tok["count"] == len(tok["tokens"])
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Mr Darcy"}]}).json()
    assert chat["tokens"][0] == 0 and chat["tokens"].count(0) == 1   # one BOS, the template's
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Mr Darcy"


def test_traceparent_is_the_requests_trace_id(planes, http):
    import structlog

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        r = http.post("/v1/completions", json={"prompt": "x", "temperature": -1},
                      headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 400
    failed = [e for e in logs if e.get("event") == "request failed"]
    assert failed and failed[0]["trace_id"] == trace_id


def test_generation_config_sets_default_sampling(tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(default_model_dir(), model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update(temperature=0.0, max_new_tokens=7)
    (model / "generation_config.json").write_text(json.dumps(cfg))
    planes = Planes(model, num_kv_blocks=128, plane_options={"http_port": 0})
    try:
        url = f"http://127.0.0.1:{planes.plane.http.port}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Hello"}], "seed": 1}
        outs = [httpx.post(url, json=body, timeout=60).json() for _ in range(2)]
        assert outs[0]["usage"]["completion_tokens"] <= 7   # max_new_tokens is the default
        assert outs[0]["choices"][0]["message"] == outs[1]["choices"][0]["message"]   # greedy
        hot = [httpx.post(url, json=body | {"temperature": 5.0, "seed": s, "max_tokens": 7},
                          timeout=60).json()["choices"][0]["message"]["content"] for s in (1, 2)]
        assert hot[0] != hot[1]   # an explicit temperature wins over the default
    finally:
        planes.close()


def test_a_failure_mid_stream_is_an_error_event_then_done(planes, http):
    import grpc

    body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        planes._loop.call_soon_threadsafe(planes.engine.fail_all, grpc.StatusCode.UNAVAILABLE,
                                          "data plane lost")
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["message"] == "data plane lost" and error["type"] == "service_unavailable"


def test_http_requests_join_the_callers_trace(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from headrace.common import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable_tracing(provider)
    try:
        traced = Planes(default_model_dir(), num_kv_blocks=64, plane_options={"http_port": 0})
    finally:
        tracing.disable_tracing()
    try:
        trace_id, parent = 0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7
        r = httpx.post(f"http://127.0.0.1:{traced.plane.http.port}/v1/completions", timeout=60,
                       json={"prompt": "Mr Darcy", "max_tokens": 3},
                       headers={"traceparent": f"00-{trace_id:032x}-{parent:016x}-01"})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
            if any(s.name == "POST /v1/completions" for s in spans):
                break
            time.sleep(0.02)
        (server,) = [s for s in spans if s.name == "POST /v1/completions"]
        assert server.parent.span_id == parent and server.parent.is_remote
        assert server.attributes["headrace.completion_tokens"] == 3
        children = {s.name for s in spans if s.parent and s.parent.span_id == server.context.span_id}
        assert {"headrace.queue", "headrace.decode"} <= children
    finally:
        traced.close()


def test_connections_disable_nagle(planes):
    """asyncio sets TCP_NODELAY only on sockets created with proto TCP; with Nagle on, the
    first SSE chunk waited ~40 ms for the client's delayed ACK."""
    import socket

    (listener,) = planes.plane.http.server.servers[0].sockets
    assert listener.proto == socket.IPPROTO_TCP
    assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_whole_response_is_built_from_one_message_per_sample(planes, http, monkeypatch):
    from headrace.controlplane.requests.request import Request

    seen = []
    original = Request.next_responses

    async def spy(self):
        responses = await original(self)
        seen.append(len(responses))
        return responses

    monkeypatch.setattr(Request, "next_responses", spy)
    r = http.post("/v1/completions", json={"prompt": "It is", "max_tokens": 12, "n": 2,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    # the engine woke the handler when a sample finished (not per token: that were ~24 messages)
    assert len(seen) <= 2 and sum(seen) <= 4


def test_an_http_port_in_use_is_port_in_use(planes):
    import subprocess
    import sys

    from headrace.common import net
    from headrace.controlplane.http.server import HttpFrontEnd

    taken = planes.plane.http.port
    second = HttpFrontEnd(planes.plane.requests, "127.0.0.1", taken)
    with pytest.raises(net.PortInUse, match=f"127.0.0.1:{taken} for HTTP.*--http-port"):
        planes.call(second.start())
    # from the command line: one line, before any data plane is started
    out = subprocess.run([sys.executable, "-P", "-m", "headrace.cli", "serve", "--port", "0", "--http-port", str(taken)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--http-port" in out.stderr and "Traceback" not in out.stderr
