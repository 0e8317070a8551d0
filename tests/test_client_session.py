"""The client library's session key (``session_id``): every call of a client carries it as the
``x-session-id`` header a load balancer hashes (deploy/envoy), a call's own key replaces it,
and HEADRACE_SESSION_ID sets it; sync and asyncio clients, against a stand-in server that
records what it received."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from headrace.client import AsyncClient, Client
from headrace.client.connection import SESSION_HEADER


class Recorder(pb_grpc.InferenceServicer):
    def __init__(self):
        self.sessions = []

    def Generate(self, request, context):
        self.sessions.append(dict(context.invocation_metadata()).get(SESSION_HEADER))
        yield pb.GenerateResponse(token_ids=[5], text="x", finish_reason=pb.FINISH_REASON_LENGTH,
                                  usage=pb.Usage(prompt_tokens=1, completion_tokens=1))


@pytest.fixture(scope="module")
def server():
    recorder, srv = Recorder(), grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_InferenceServicer_to_server(recorder, srv)
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", recorder
    srv.stop(0)


def test_a_clients_calls_carry_its_session_and_a_call_may_name_its_own(server, monkeypatch):
    address, recorder = server
    recorder.sessions.clear()
    with Client(address, session_id="alice") as client:
        client.generate("hi", max_tokens=1)
        list(client.stream("hi", max_tokens=1))
        client.generate("hi", max_tokens=1, session_id="bob")
    with Client(address) as client:
        client.generate("hi", max_tokens=1)
    monkeypatch.setenv("HEADRACE_SESSION_ID", "carol")
    with Client(address) as client:
        client.generate("hi", max_tokens=1)
    assert recorder.sessions == ["alice", "alice", "bob", None, "carol"]


def test_the_asyncio_client_carries_it_too(server):
    address, recorder = server
    recorder.sessions.clear()

    async def run():
        async with AsyncClient(address, session_id="dave") as client:
            await client.generate("hi", max_tokens=1)
            async for _ in client.stream("hi", max_tokens=1, session_id="erin"):
                pass

    asyncio.run(run())
    assert recorder.sessions == ["dave", "erin"]
