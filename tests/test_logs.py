"""Structured logs: JSON when not on a terminal, console on one; every line about a request
carries its request id and trace id; prompt text only when asked for."""

from __future__ import annotations

import io
import json
import logging
import time

import grpc
import pytest

from headrace.common.logs import configure_library_default, configure_logging
from headrace.v1 import inference_pb2 as pb

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def captured():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    yield buf
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    configure_library_default()


def _lines(buf) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_format_follows_the_terminal(captured, monkeypatch):
    monkeypatch.delenv("HEADRACE_LOG_FORMAT", raising=False)
    assert configure_logging(stream=io.StringIO(), cache_loggers=False) == "json"
    tty = _Tty()
    assert configure_logging(stream=tty, cache_loggers=False) == "console"
    logging.getLogger("headrace.test").info("hello %s", "there")
    assert "hello there" in tty.getvalue() and not tty.getvalue().lstrip().startswith("{")
    monkeypatch.setenv("HEADRACE_LOG_FORMAT", "json")
    assert configure_logging(stream=_Tty(), cache_loggers=False) == "json"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_uvicorns_colour_copy_of_its_message_stays_out_of_our_lines(captured, fmt):
    out = io.StringIO()
    configure_logging(fmt, stream=out, cache_loggers=False)
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on %s", "http://127.0.0.1:8000",
        extra={"color_message": "Uvicorn running on \x1b[1m%s\x1b[0m", "port": 8000})
    text = out.getvalue()
    assert "Uvicorn running on http://127.0.0.1:8000" in text
    assert "color_message" not in text and "\x1b" not in text   # no ANSI codes off a terminal
    assert "8000" in text.replace("127.0.0.1:8000", "")   # other extras are kept


def test_request_lines_carry_request_and_trace_ids_and_no_prompt(llama_planes, captured):
    configure_logging("json", stream=captured, cache_loggers=False)
    secret = "the quick brown fox"
    list(llama_planes.stub.Generate(pb.GenerateRequest(prompt=secret, max_tokens=3, request_id="log-1"),
                                    metadata=[("traceparent", TRACEPARENT)], timeout=60))
    with pytest.raises(grpc.RpcError):
        list(llama_planes.stub.Generate(pb.GenerateRequest(prompt=secret, max_tokens=0, request_id="log-2"),
                                        metadata=[("traceparent", TRACEPARENT)], timeout=60))
    # the server logs a failed request after the client already has its status: wait for it
    deadline = time.monotonic() + 5
    while (not any(x["event"] == "request failed" for x in _lines(captured))
           and time.monotonic() < deadline):
        time.sleep(0.01)
    lines = _lines(captured)
    assert secret not in captured.getvalue()
    finished = [x for x in lines if x["event"] == "request finished"]
    assert len(finished) == 1 and finished[0]["request_id"] == "log-1"
    assert finished[0]["trace_id"] == TRACE_ID and finished[0]["completion_tokens"] == 3
    assert finished[0]["level"] == "info" and finished[0]["logger"] == "headrace.requests"
    assert "timestamp" in finished[0] and finished[0]["ttft_s"] > 0
    failed = [x for x in lines if x["event"] == "request failed"]
    assert failed and failed[0]["request_id"] == "log-2" and failed[0]["trace_id"] == TRACE_ID
    assert failed[0]["code"] == "INVALID_ARGUMENT"
    for line in lines:
        if "request" in line["event"]:
            assert line.get("request_id") and len(line.get("trace_id", "")) == 32


def test_requests_without_traceparent_get_a_trace_id(llama_planes, captured):
    configure_logging("json", stream=captured, cache_loggers=False)
    list(llama_planes.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, request_id="log-3"),
                                    timeout=60))
    (line,) = [x for x in _lines(captured) if x.get("request_id") == "log-3"]
    assert len(line["trace_id"]) == 32 and int(line["trace_id"], 16)


def test_prompts_are_logged_only_when_asked(llama_planes, captured):
    configure_logging("json", stream=captured, cache_loggers=False)
    llama_planes.plane.requests.log_prompts = True
    try:
        list(llama_planes.stub.Generate(pb.GenerateRequest(prompt="the lazy dog", max_tokens=2,
                                                           request_id="log-4"), timeout=60))
    finally:
        llama_planes.plane.requests.log_prompts = False
    (received,) = [x for x in _lines(captured) if x["event"] == "request received"]
    assert received["prompt"] == "the lazy dog" and received["request_id"] == "log-4"
    assert received["prompt_token_ids"]
