"""Runs both planes inside the test process over real gRPC: a data plane worker on a unix
socket and a control plane (in its own event-loop thread) on a TCP port of 127.0.0.1: in one
piece (``ControlPlane``), or split as ``headrace serve`` runs it, an engine core and an API
front end talking over the core's stream (``split=True``).

HEADRACE_TEST_DEVICE=cuda runs the worker on the GPU (fp32, Triton kernels, CUDA graphs), so
the same end-to-end tests check the GPU path against transformers on the device machine.
``workers=[addresses]`` runs the control plane over already running data planes instead."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import tempfile
import threading
import time

import grpc

from headrace.controlplane.core.server import CoreServer
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.frontend.server import FrontEnd
from headrace.controlplane.server import ControlPlane
from headrace.dataplane.server import serve
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc


DEVICE = os.environ.get("HEADRACE_TEST_DEVICE", "cpu")


class Planes:
    def __init__(self, model_dir: str | pathlib.Path, *, num_kv_blocks: int = 256,
                 block_size: int = 16, config: EngineConfig | None = None,
                 workers: list[str] | None = None, worker_address: str | None = None,
                 worker_options: dict | None = None, plane_options: dict | None = None,
                 secure_channel: grpc.ChannelCredentials | None = None, split: bool = False,
                 host: str = "127.0.0.1", worker_fields: dict | None = None,
                 core_address: str | None = None, core_options: dict | None = None):
        """``worker_options`` go to the data plane's ``serve`` (credentials, secret),
        ``plane_options`` to ``ControlPlane`` (api_token, tls, worker_credentials, ...).
        ``split``: an engine core and one API front end (the layout of ``headrace serve``, here
        in one event loop over the core's unix socket) instead of ``ControlPlane``; then
        ``self.plane`` is the front end and ``self.core`` the core. ``host``: where the control
        plane listens (clients connect on 127.0.0.1). ``worker_fields``: WorkerOptions fields
        replacing the test defaults (dtype, attention_backend, ...). ``core_address`` (split:
        default a unix socket; ``127.0.0.1:0`` an ephemeral TCP port) and ``core_options``
        (split: ``core`` and ``frontend`` keyword dicts, e.g. the link's TLS and secret)."""
        self._tmp = tempfile.mkdtemp(prefix="headrace-test-")
        self.worker = self.worker_server = None
        self.worker_options = worker_options or {}
        if workers is None:
            self.worker_address = worker_address or f"unix:{self._tmp}/dp.sock"
            fields = dict(model=str(model_dir), num_kv_blocks=num_kv_blocks, block_size=block_size,
                          device=DEVICE, dtype="float32", max_num_seqs=64)
            self.worker = Worker(WorkerOptions(**(fields | (worker_fields or {}))))
            self.worker_server = serve(self.worker, self.worker_address, **self.worker_options)
            if self.worker_address.endswith(":0"):   # an ephemeral TCP port: use the bound one
                self.worker_address = f"127.0.0.1:{self.worker_server.worker_port}"
            workers = [self.worker_address]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def build():
            plane = ControlPlane(str(model_dir), workers, f"{host}:0", config, **(plane_options or {}))
            await plane.start(ready_timeout=180)   # several ranks load at once on 2 cores
            return plane

        async def build_split():
            address = core_address or f"unix:{self._tmp}/core.sock"
            link = core_options or {}
            core = dict(link.get("core", {}))   # (the front end's loopback opt-in reaches the core)
            core.setdefault("admin_insecure_loopback", (plane_options or {}).get("admin_insecure_loopback", False))
            self.core = CoreServer(str(model_dir), workers, address, config, **core)
            await self.core.start(ready_timeout=180)
            if address.endswith(":0"):   # an ephemeral TCP port: the bound one
                address = f"{address.rsplit(':', 1)[0]}:{self.core.port}"
            self.core_address = address
            frontend = FrontEnd(0, address, str(model_dir), "127.0.0.1:0", reuse_port=False,
                                **(plane_options or {}), **link.get("frontend", {}))
            await frontend.start()
            while not frontend.client.ready:
                await asyncio.sleep(0.01)
            return frontend

        self.core = None
        self.plane = self.call(build_split() if split else build())
        self.address = f"127.0.0.1:{self.plane.port}"
        self.channel = (grpc.secure_channel(self.address, secure_channel) if secure_channel
                        else grpc.insecure_channel(self.address))
        self.stub = pb_grpc.InferenceStub(self.channel)

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def engine(self):
        return self.core.engine if self.core is not None else self.plane.engine

    @property
    def free_blocks(self) -> int:
        return self.engine.scheduler.blocks.num_free

    def wait_for_free_blocks(self, expected: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self.free_blocks != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.free_blocks

    def generate(self, **fields) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(pb.GenerateRequest(**fields), timeout=120))

    def close(self) -> None:
        """Stops everything this started and removes its temporary directory. (The loop is
        stopped, not closed: gRPC's shared poller may still deliver a late completion to it.)"""
        self.channel.close()
        with contextlib.suppress(Exception):
            self.call(self.plane.stop(grace=1))
        if self.core is not None:
            with contextlib.suppress(Exception):
                self.call(self.core.stop(grace=1))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if self.worker_server is not None:
            self.worker_server.stop(0).wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


def completion(responses: list[pb.GenerateResponse]) -> tuple[list[int], str, int]:
    """(token ids, text, finish reason) of one finished stream."""
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text for r in responses), responses[-1].finish_reason
