"""Malformed input below the request models (issue 29): protobuf bytes that do not parse and
integers wider than their 32-bit field are INVALID_ARGUMENT on gRPC (not UNKNOWN, not a token
id silently cut to its low 32 bits); out-of-range JSON numbers are HTTP 400 naming the field
(not 500); an HTTP connection whose headers trickle in, or that idles, is closed."""

from __future__ import annotations

import socket
import time

import grpc
import httpx
import pytest

from headrace.controlplane.requests import wire_check
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion
from tests.checkpoints import make_checkpoint

TIMEOUTS = (1.0, 1.0)   # header, keep-alive: short for the test


@pytest.fixture(scope="module")
def planes(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)
    p = Planes(path, num_kv_blocks=64, plane_options=dict(http_port=0, http_timeouts=TIMEOUTS,
                                                          admin_insecure_loopback=True))
    yield p
    p.close()


def _raw(planes, method: str, streaming: bool):
    identity = lambda b: b  # noqa: E731
    factory = planes.channel.unary_stream if streaming else planes.channel.unary_unary
    return factory(method, request_serializer=identity, response_deserializer=identity)


def _wide(cls, **fields) -> bytes:
    """``cls``'s bytes with 32-bit integer fields set beyond their range."""
    wide = wire_check._wide_class(cls.DESCRIPTOR)()
    for name, value in fields.items():
        target = wide
        *path, leaf = name.split(".")
        for part in path:
            target = getattr(target, part)
        field = getattr(target, leaf)
        field.extend(value) if isinstance(value, list) else setattr(target, leaf, value)
    return wide.SerializeToString()


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            list(result)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_garbage_protobuf_bytes_are_invalid_argument(planes):
    garbage = b"\xff\xff\xff\xff\x0fnot a protobuf message"
    for method, streaming in (("/headrace.v1.Inference/Generate", True),
                              ("/headrace.v1.Inference/Tokenize", False),
                              ("/headrace.v1.Admin/UpdateConfig", False)):
        code, details = _code(lambda: _raw(planes, method, streaming)(garbage, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert "malformed protobuf" in details
    assert completion(planes.generate(prompt="hello", max_tokens=2, ignore_eos=True))[2]


def test_integers_wider_than_their_field_are_invalid_argument(planes):
    generate = _raw(planes, "/headrace.v1.Inference/Generate", True)
    for fields, named in (({"prompt_token_ids.ids": [5, 1 << 40]}, "prompt_token_ids.ids: 1099511627776"),
                          ({"prompt_token_ids.ids": [5], "max_tokens": 1 << 33}, "max_tokens"),
                          ({"prompt_token_ids.ids": [5], "n": 1 << 32}, "n: 4294967296"),
                          ({"prompt": "hi", "stop_token_ids": [1 << 32]}, "stop_token_ids"),
                          ({"prompt": "hi", "sampling.top_k": -(1 << 40)}, "sampling.top_k")):
        code, details = _code(lambda: generate(_wide(pb.GenerateRequest, **fields), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(named), (fields, details)
    update = _raw(planes, "/headrace.v1.Admin/UpdateConfig", False)
    code, details = _code(lambda: update(_wide(apb.UpdateConfigRequest, max_queued=1 << 36), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_queued")
    # in range, negative int32 values included, the same bytes go through untouched
    ok = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]), max_tokens=2, priority=-3,
                            ignore_eos=True)
    assert list(generate(ok.SerializeToString(), timeout=30))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 1e20}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -(10 ** 30)}, "max_tokens"),
    ({"prompt": [1, 1 << 40]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": "x", "priority": 10 ** 12}, "priority"),
    ({"prompt": "x", "min_tokens": -(1 << 40)}, "min_tokens"),
    ({"prompt": "x", "top_k": 1 << 40}, "top_k"),
    ({"prompt": "x", "stop_token_ids": [1 << 33]}, "stop_token_ids"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "temperature": 1e39}, "temperature"),
    ({"prompt": "x", "n": 10 ** 9}, "n"),
])
def test_out_of_range_json_numbers_are_400_naming_the_field(planes, body, param):
    url = f"http://127.0.0.1:{planes.plane.http.port}/v1/completions"
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Traceback" not in r.text


def test_chat_and_detokenize_numbers_are_bounded_too(planes):
    base = f"http://127.0.0.1:{planes.plane.http.port}"
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": 1e20}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = httpx.post(f"{base}/detokenize", json={"tokens": [1 << 40]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (sending ``trickle`` a byte at a time every
    0.2 s meanwhile), or None if it stayed open ``seconds``."""
    sock.settimeout(0.2)
    start, i = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        try:
            if i < len(trickle):
                sock.sendall(trickle[i:i + 1])
                i += 1
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def test_slow_headers_and_idle_connections_are_closed(planes):
    port = planes.plane.http.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: a\r\n" * 40
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        # three trickle their headers (slowloris), one sends nothing at all
        closed = [_closed_within(s, 6, head if i < 3 else b"") for i, s in enumerate(socks)]
        assert all(c is not None and c < 3 for c in closed), closed
    finally:
        for s in socks:
            s.close()
    # an idle keep-alive connection goes after its timeout; the server keeps serving
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30).status_code == 200
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        assert _closed_within(sock, 6) is not None
