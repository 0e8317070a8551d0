"""The client library (``headrace.client``) against live planes: typed results of generate,
stream, tokenize and model info (sync and asyncio), the API's defaults, exceptions mapped from
gRPC statuses, the connect timeout naming the state (down, loading, draining), the API token
(argument and HEADRACE_API_TOKEN) and mutual TLS."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from headrace.common import security
from headrace.controlplane.server import ControlPlane
from headrace.v1 import inference_pb2 as pb
from headrace.client import (AsyncClient, Client, Completion, InvalidRequest, NotReady, ServerBusy,
                             Unauthenticated, Unavailable)
from headrace.client.errors import from_rpc_error
from headrace.client.types import build_request
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def planes(model_dir):
    p = Planes(model_dir, num_kv_blocks=128)
    yield p
    p.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_stream_tokenize_model_info(planes):
    with Client(planes.address) as client:
        assert client.health() == "serving"
        done = client.generate("hello world", max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        assert isinstance(done, Completion)
        ids, text, _ = completion(planes.generate(prompt="hello world", max_tokens=6, ignore_eos=True,
                                                  sampling=pb.SamplingParams(temperature=0)))
        assert (done.token_ids, done.text, done.finish_reason) == (ids, text, "length")
        assert done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 0
        assert [lp.token_id for lp in done.logprobs] == ids and len(done.logprobs[0].top) == 2
        chunks = list(client.stream("hello world", max_tokens=6, temperature=0, ignore_eos=True))
        assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        assert [t for c in chunks for t in c.token_ids] == ids
        assert "".join(c.text for c in chunks) == text
        from_ids = client.generate(token_ids=ids[:3], max_tokens=2, temperature=0, ignore_eos=True)
        assert len(from_ids.token_ids) == 2
        two = client.generate("hi", n=2, max_tokens=3, ignore_eos=True, seed=1)
        assert [c.index for c in two] == [0, 1]
        tokens = client.tokenize("hello world")
        assert tokens.token_ids and len(tokens.tokens) == len(tokens.token_ids)
        info = client.model_info()
        assert info.num_kv_blocks == 128 and info.max_model_len > 0 and info.device


def test_leaving_a_stream_early_cancels_the_request(planes):
    with Client(planes.address) as client:
        for chunk in client.stream("hello", max_tokens=200, ignore_eos=True):
            break
    assert planes.wait_for_free_blocks(128) == 128


def test_unset_options_take_the_servers_defaults():
    req = build_request("hi")
    assert not req.HasField("sampling") and not req.HasField("max_tokens")
    assert req.n == 0 and req.stream_interval == 0 and not req.stop
    req = build_request("hi", temperature=0.0, stop="x")
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0 and req.stop == ["x"]
    with pytest.raises(TypeError):
        build_request("hi", temprature=1.0)
    with pytest.raises(TypeError):
        build_request()


def test_errors_are_mapped_from_grpc_statuses(planes):
    with Client(planes.address) as client:
        with pytest.raises(InvalidRequest, match="temperature"):
            client.generate("hi", temperature=-1)
        with pytest.raises(InvalidRequest):
            list(client.stream("hi", top_p=2.0))

    class Failed(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "why"

    assert isinstance(from_rpc_error(Failed(grpc.StatusCode.RESOURCE_EXHAUSTED)), ServerBusy)
    assert isinstance(from_rpc_error(Failed(grpc.StatusCode.UNAVAILABLE)), Unavailable)
    assert str(from_rpc_error(Failed(grpc.StatusCode.UNAUTHENTICATED))) == "UNAUTHENTICATED: why"


def test_connect_timeout_names_a_server_that_is_down():
    start = time.monotonic()
    with Client(f"127.0.0.1:{_free_port()}", connect_timeout=1.0) as client:
        assert client.health() == "down"
        with pytest.raises(NotReady, match="is down") as info:
            client.generate("hi")
    assert info.value.state == "down" and time.monotonic() - start < 5


def test_connect_timeout_names_a_draining_server(planes):
    planes.call(planes.plane.drain(0))
    try:
        with Client(planes.address, connect_timeout=0.5) as client:
            assert client.health() == "draining"
            with pytest.raises(NotReady, match="draining") as info:
                client.generate("hi")
            assert info.value.state == "draining"
    finally:
        planes.call(planes.plane.resume())


def test_draining_is_seen_without_access_to_admin(model_dir):
    """A server with an admin token denies GetConfig: GetModelInfo (answered while draining,
    not while loading) tells draining from loading."""
    p = Planes(model_dir, num_kv_blocks=32, plane_options={"admin_token": "adm"})
    try:
        p.call(p.plane.drain(0))
        assert Client(p.address).health() == "draining"
    finally:
        p.close()


def test_connect_timeout_names_a_loading_server(model_dir, tmp_path):
    """The control plane is up, its data plane is not (yet)."""
    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)  # noqa: E731

    async def build():
        plane = ControlPlane(str(model_dir), [f"unix:{tmp_path}/nobody.sock"], "127.0.0.1:0")
        task = asyncio.get_running_loop().create_task(plane.start(ready_timeout=30))
        while not plane.port:
            await asyncio.sleep(0.01)
        return plane, task

    plane, task = run(build())
    try:
        with Client(f"127.0.0.1:{plane.port}", connect_timeout=0.5) as client:
            assert client.health() == "loading"
            with pytest.raises(NotReady, match="loading") as info:
                client.model_info()
            assert info.value.state == "loading"
    finally:
        async def stop():
            task.cancel()
            await plane.stop(0)
        run(stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_api_token_from_argument_or_environment(model_dir, monkeypatch):
    p = Planes(model_dir, num_kv_blocks=32, plane_options={"api_token": "s3cret"})
    try:
        monkeypatch.delenv("HEADRACE_API_TOKEN", raising=False)
        with Client(p.address) as client, pytest.raises(Unauthenticated):
            client.generate("hi", max_tokens=2)
        with Client(p.address, api_token="s3cret") as client:
            assert client.generate("hi", max_tokens=2, ignore_eos=True).finish_reason == "length"
        monkeypatch.setenv("HEADRACE_API_TOKEN", "s3cret")
        monkeypatch.setenv("HEADRACE_ADDRESS", p.address)
        with Client() as client:
            assert client.model_info().num_kv_blocks == 32
    finally:
        p.close()


def test_mutual_tls(model_dir, certs, monkeypatch):
    c = lambda n: str(certs / n)  # noqa: E731
    tls = security.server_credentials(c("server.pem"), c("server.key"), c("ca.pem"))
    p = Planes(model_dir, num_kv_blocks=32, plane_options={"tls": tls},
               secure_channel=security.channel_credentials(c("ca.pem"), c("client.pem"), c("client.key")))
    try:
        with Client(p.address, tls_ca=c("ca.pem"), tls_cert=c("client.pem"), tls_key=c("client.key")) as client:
            assert client.generate("hi", max_tokens=2, ignore_eos=True).finish_reason == "length"
        monkeypatch.setenv("HEADRACE_TLS_CA", c("ca.pem"))
        with Client(p.address, connect_timeout=1) as client, pytest.raises(NotReady):   # no client cert
            client.generate("hi", max_tokens=2)
        monkeypatch.setenv("HEADRACE_TLS_CERT", c("client.pem"))
        monkeypatch.setenv("HEADRACE_TLS_KEY", c("client.key"))
        with Client(p.address) as client:
            assert client.tokenize("hi").token_ids
    finally:
        p.close()
    with pytest.raises(ValueError, match="no such file"):
        Client("localhost:1", tls_ca=c("missing.pem"))


def test_async_client(planes):
    async def main():
        async with AsyncClient(planes.address) as client:
            assert await client.health() == "serving"
            done = await client.generate("hello world", max_tokens=5, temperature=0, ignore_eos=True)
            chunks = [c async for c in client.stream("hello world", max_tokens=5, temperature=0,
                                                     ignore_eos=True)]
            assert [t for c in chunks for t in c.token_ids] == done.token_ids
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
            assert (await client.tokenize("hello")).token_ids
            assert (await client.model_info()).num_kv_blocks == 128
            with pytest.raises(InvalidRequest):
                await client.generate("hi", top_k=-5)
        async with AsyncClient(f"127.0.0.1:{_free_port()}", connect_timeout=0.5) as client:
            with pytest.raises(NotReady) as info:
                await client.generate("hi")
            assert info.value.state == "down"

    asyncio.run(main())


def test_the_methods_show_their_options_and_refuse_a_typo_at_the_call():
    import inspect

    request_options = set(inspect.signature(build_request).parameters)
    with Client("127.0.0.1:1", connect_timeout=0.1) as client:
        for method in (client.generate, client.stream, AsyncClient.generate, AsyncClient.stream):
            params = set(inspect.signature(method).parameters) - {"self"}
            assert params == request_options | {"timeout", "session_id"}, method
            assert all(p.kind is not inspect.Parameter.VAR_KEYWORD
                       for p in inspect.signature(method).parameters.values())
        for call in (client.generate, client.stream):
            typo = rf"{call.__name__}\(\) got an unexpected keyword argument 'temprature'"
            with pytest.raises(TypeError, match=typo):
                call("hi", temprature=0.5)   # stream too: at the call, before any iteration
    aio = AsyncClient("127.0.0.1:1")
    with pytest.raises(TypeError, match=r"stream\(\) got an unexpected keyword argument 'max_token'"):
        aio.stream("hi", max_token=3)
    with pytest.raises(TypeError, match=r"generate\(\) got an unexpected keyword argument 'max_token'"):
        aio.generate("hi", max_token=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'token'"):
        Client("127.0.0.1:1", token="x")
    assert set(inspect.signature(Client).parameters) == set(inspect.signature(AsyncClient).parameters) == {
        "address", "api_token", "tls", "tls_ca", "tls_cert", "tls_key", "connect_timeout", "session_id"}
