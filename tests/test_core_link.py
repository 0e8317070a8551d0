"""The link between the API front ends and the engine core
(``headrace.controlplane.core.security``): the unix socket is its owner's only; a TCP core serves
TLS and only front ends presenting its secret (health stays open), and a front end answers and
reaches Admin through it; a front end with a wrong secret or no TLS never connects; a TCP core
address beyond loopback without TLS or a secret is refused before anything starts. Certificates:
``certs`` (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.cli.main import main
from headrace.common import security
from headrace.controlplane.core import security as core_link
from headrace.controlplane.core.server import CoreServer
from headrace.controlplane.frontend.server import FrontEnd
from headrace.dataplane.default_model import default_model_dir
from headrace.core.v1 import core_pb2 as cpb
from headrace.core.v1 import core_pb2_grpc as cpb_grpc
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.harness import Planes, completion

MODEL = str(default_model_dir())
SECRET = "core-s3cret"
GREEDY = pb.SamplingParams(temperature=0)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def test_the_unix_socket_is_its_owners_only():
    old = os.umask(0o000)   # a permissive umask must not leak into the socket's mode
    try:
        planes = Planes(MODEL, split=True)
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(planes.core_address[5:]).st_mode)
        assert stat.S_ISSOCK(os.stat(planes.core_address[5:]).st_mode) and mode == 0o600, oct(mode)
        assert completion(planes.generate(prompt="The river", max_tokens=4, sampling=GREEDY))[2] == \
            pb.FINISH_REASON_LENGTH
    finally:
        planes.close()


@pytest.fixture(scope="module")
def tcp(certs):
    c = lambda n: str(certs / n)  # noqa: E731
    options = {"core": {"core_tls": security.server_credentials(c("server.pem"), c("server.key")),
                        "core_secret": SECRET},
               "frontend": {"core_credentials": security.channel_credentials(c("ca.pem")),
                            "core_secret": SECRET}}
    planes = Planes(MODEL, split=True, core_address="127.0.0.1:0", core_options=options,
                    plane_options={"admin_insecure_loopback": True})
    yield planes, certs
    planes.close()


def _front_end(planes, **link) -> FrontEnd:
    async def start():
        frontend = FrontEnd(1, planes.core_address, MODEL, "127.0.0.1:0", reuse_port=False, **link)
        await frontend.start()
        return frontend
    return planes.call(start())


def _connect(channel, metadata=()):
    """Opens an EngineCore stream (a Hello) and reads its first message."""
    stream = cpb_grpc.EngineCoreStub(channel).Connect(
        iter([cpb.Up(hello=cpb.Hello(frontend_index=9))]), metadata=metadata, timeout=10)
    return next(stream)


@needs_openssl
def test_a_tcp_core_serves_tls_to_front_ends_with_its_secret(tcp):
    planes, certs = tcp
    assert planes.core_address.startswith("127.0.0.1:")
    got = completion(planes.generate(prompt="The river", max_tokens=6, sampling=GREEDY))
    assert got[2] == pb.FINISH_REASON_LENGTH and len(got[0]) == 6
    admin = apb_grpc.AdminStub(planes.channel)   # Admin through the front end, to the TCP core
    assert admin.GetConfig(apb.GetConfigRequest(), timeout=10).num_kv_blocks > 0
    tls = security.channel_credentials(str(certs / "ca.pem"))
    with grpc.secure_channel(planes.core_address, tls) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING   # health stays open
        assert _connect(channel, core_link.metadata(SECRET)).state.loaded
        for metadata in ((), core_link.metadata("wrong")):
            with pytest.raises(grpc.RpcError) as err:
                _connect(channel, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                apb_grpc.AdminStub(channel).GetConfig(apb.GetConfigRequest(), metadata=metadata,
                                                      timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(planes.core_address) as plaintext, pytest.raises(grpc.RpcError) as err:
        _connect(plaintext, core_link.metadata(SECRET))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE   # no TLS, no connection


@needs_openssl
def test_front_ends_without_the_secret_or_tls_never_connect(tcp):
    planes, certs = tcp
    tls = security.channel_credentials(str(certs / "ca.pem"))
    outsiders = [_front_end(planes, core_credentials=tls, core_secret="wrong"),
                 _front_end(planes, core_secret=SECRET)]   # plaintext to a TLS core
    try:
        time.sleep(1.5)   # a few reconnection attempts
        for frontend in outsiders:
            assert not frontend.client.connected and not frontend.client.ready
            with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel, \
                    pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(
                    pb.GenerateRequest(prompt="The river", max_tokens=2), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for frontend in outsiders:
            planes.call(frontend.stop(grace=0))


def test_a_core_link_beyond_loopback_needs_tls_and_a_secret(capsys, monkeypatch):
    import structlog

    from headrace.cli import main as cli_main

    # main() configures the process's logging and binds its role: in-process here, it must
    # not leave them behind for later tests (conftest keeps loggers uncached)
    monkeypatch.setattr(cli_main, "bind_role", lambda args: None)
    saved = structlog.get_config()
    core_link.check("unix:/tmp/x.sock", False, None)
    core_link.check("127.0.0.1:7000", False, None)    # loopback: plaintext allowed
    core_link.check("10.1.2.3:7000", True, "s")
    for tls, secret, what in ((False, "s", "TLS"), (True, None, "secret")):
        with pytest.raises(ValueError, match=what):
            core_link.check("10.1.2.3:7000", tls, secret)
    with pytest.raises(ValueError, match="beyond loopback"):
        CoreServer(MODEL, ["unix:/nonexistent.sock"], "0.0.0.0:0", core_secret="s")
    with pytest.raises(ValueError, match="beyond loopback"):
        asyncio.run(_frontend_beyond_loopback())
    # serve says so in one line before it starts anything
    try:
        assert main(["serve", "--core-address", "0.0.0.0:7999", "--port", "0", "--http-port", "0",
                     "--metrics-port", "0"]) == 2
    finally:
        structlog.configure(**saved)
    assert "beyond loopback" in capsys.readouterr().err


async def _frontend_beyond_loopback():
    FrontEnd(0, "10.1.2.3:7000", MODEL, "127.0.0.1:0", core_secret="s")
