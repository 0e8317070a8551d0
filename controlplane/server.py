"""Assembles the control plane's gRPC server: Inference, grpc.health.v1 and reflection, with
deliberate message-size and keepalive settings; runs it until told to stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane.engine import Engine, EngineConfig
from controlplane.service import InferenceService
from controlplane.tokenizer import ModelTokenizer
from controlplane.worker_client import WorkerGroup
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("headrace.controlplane")

INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class ControlPlane:
    """The public server and its engine. ``start`` returns once the port is bound; the
    model becomes ready (health SERVING) when the workers have answered."""

    def __init__(self, model_dir: str, worker_addresses: list[str], address: str,
                 config: EngineConfig | None = None):
        self.tokenizer = ModelTokenizer(model_dir)
        self.workers = WorkerGroup(worker_addresses)
        self.engine = Engine(self.workers, config or EngineConfig())
        self.address = address
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_InferenceServicer_to_server(
            InferenceService(self.engine, self.tokenizer, len(worker_addresses)), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (INFERENCE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = 0

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", INFERENCE):
            await self.health.set(name, status)

    async def start(self, ready_timeout: float = 600.0) -> None:
        await self._set_health(False)
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.address}")
        await self.server.start()
        log.info("control plane listening on %s; waiting for the data plane", self.address)
        await self.engine.start(ready_timeout)
        await self._set_health(True)
        log.info("model %s ready: %d KV blocks of %d tokens, max_model_len %d",
                 self.engine.info.model_name, self.engine.scheduler.blocks.num_blocks,
                 self.engine.info.block_size, self.engine.max_model_len)

    async def stop(self, grace: float = 10.0) -> None:
        """Graceful: NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace``."""
        await self._set_health(False)
        await self.server.stop(grace)
        await self.engine.stop()


async def serve_until_signal(model_dir: str, worker_addresses: list[str], address: str,
                             config: EngineConfig, grace: float = 10.0) -> None:
    """Runs a control plane (built inside the running event loop) until SIGINT/SIGTERM."""
    plane = ControlPlane(model_dir, worker_addresses, address, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(plane.start())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done:
        starting.result()  # raise start-up errors
        await waiter
    else:
        starting.cancel()
    log.info("shutting down")
    await plane.stop(grace)
