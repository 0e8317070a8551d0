"""Listening addresses: a port in use fails start-up with a clear error instead of being
shared through SO_REUSEPORT (control plane and data plane), loopback detection, and the
warning when the API is open to the network."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from headrace.common import net
from headrace.controlplane.server import ControlPlane
from headrace.dataplane.server import serve
from tests.checkpoints import make_checkpoint
from tests.harness import Planes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)


def test_check_port_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(net.PortInUse, match=f"127.0.0.1:{port}.*another server on port {port}"):
            net.check_port(f"127.0.0.1:{port}")
    net.check_port(f"127.0.0.1:{port}")   # free again
    net.check_port("127.0.0.1:0")
    net.check_port("unix:/tmp/whatever.sock")
    with pytest.raises(net.PortInUse, match="unknown host"):
        net.check_port("no-such-host.invalid:50051")


def test_loopback_hosts():
    assert net.is_loopback("127.0.0.1") and net.is_loopback("::1") and net.is_loopback("localhost")
    assert not net.is_loopback("0.0.0.0") and not net.is_loopback("::") and not net.is_loopback("10.0.0.1")
    assert net.split_address("[::1]:50051") == ("::1", 50051) and net.split_address("unix:/x") is None


def test_a_second_control_plane_on_the_same_port_fails(model_dir):
    first = Planes(model_dir, num_kv_blocks=32)
    try:
        async def second():
            plane = ControlPlane(str(model_dir), [first.worker_address], first.address)
            try:
                await plane.start(ready_timeout=5)
            finally:
                await plane.stop(0)

        with pytest.raises(net.PortInUse, match=first.address):
            asyncio.run(second())
        # the first still serves alone
        assert first.generate(prompt="hi", max_tokens=2, ignore_eos=True)[-1].finish_reason
    finally:
        first.close()


def test_a_second_data_plane_on_the_same_port_fails(model_dir):
    server = serve(None, "127.0.0.1:0")
    try:
        with pytest.raises(net.PortInUse):
            serve(None, f"127.0.0.1:{server.worker_port}")
    finally:
        server.stop(0).wait()


def test_the_log_says_when_the_api_is_open(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="headrace.controlplane"):
        local = Planes(model_dir, num_kv_blocks=32)
        local.close()
    assert not any("open to the network" in r.getMessage() for r in caplog.records)
    async def start_and_stop():
        plane = ControlPlane(str(model_dir), ["unix:/nonexistent.sock"], "0.0.0.0:0")
        task = asyncio.create_task(plane.start(ready_timeout=5))
        while not plane.port:
            await asyncio.sleep(0.01)
        task.cancel()
        await plane.stop(0)

    with caplog.at_level(logging.INFO, logger="headrace.controlplane"):
        asyncio.run(start_and_stop())
    assert any("open to the network (plaintext, no API token)" in r.getMessage() for r in caplog.records)
