"""The engine-core process (``headrace core``): one ``EnginePlane`` and a private gRPC server (a
unix socket under the serve's private directory by default; TCP possible) with the ``EngineCore``
stream the front ends hold, the Admin service they proxy to, and health. It also serves the control
plane's one Prometheus /metrics: with ``PROMETHEUS_MULTIPROC_DIR`` set (as ``headrace serve`` sets
it for all its control-plane processes) the counters and histograms of every front end are summed
in, beside the core's live gauges. ``headrace.controlplane.core.security`` says how the link is
secured (a 0600 unix socket; TLS and a shared secret on TCP).

One of several data-parallel cores (``data_parallel_size`` > 1) mirrors its live gauges into the
shared metric files, and core 0's /metrics adds their totals
(``headrace.controlplane.frontend.dp_metrics``)."""

from __future__ import annotations

import logging
import os

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from headrace.common.grpc_options import CORE_MAX_MESSAGE_BYTES, server_options
from headrace.common.metrics import multiprocess_registry
from headrace.controlplane.core import security as core_link
from headrace.controlplane.frontend import dp_metrics
from headrace.controlplane.engine import step_watchdog
from headrace.controlplane.admin import AdminService
from headrace.controlplane.core.plane import EnginePlane
from headrace.controlplane.core.service import EngineCoreService
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.metrics import engine_state_collector
from headrace.controlplane.lifecycle import BackgroundTasks, set_health
from headrace.core.v1 import core_pb2_grpc as cpb_grpc
from headrace.v1 import admin_pb2_grpc as apb_grpc

log = logging.getLogger("headrace.core")


class CoreServer:
    def __init__(self, model_dir: str, worker_addresses: list[str], address: str,
                 config: EngineConfig | None = None, *, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", admin_token: str | None = None,
                 core_tls: grpc.ServerCredentials | None = None, core_secret: str | None = None,
                 admin_insecure_loopback: bool = False, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1, **plane_options):
        """``core_tls``: serve a TCP ``address`` with TLS; ``core_secret``: serve only front ends
        presenting it (``headrace.controlplane.core.security``); ``admin_insecure_loopback``:
        without a core secret or an admin token, serve Admin to loopback callers
        (``headrace.controlplane.admin``); ``data_parallel_rank``: which of the server's
        data-parallel cores this is (traces, logs, per-core metrics)."""
        core_link.check(address, core_tls is not None, core_secret)
        self.plane = EnginePlane(model_dir, worker_addresses, config, **plane_options)
        self.engine = self.plane.engine
        self.address, self.tls = address, core_tls
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.dp_rank, self.dp_size = data_parallel_rank, data_parallel_size
        if data_parallel_size > 1:   # the cores' profiles share a directory: names apart
            self.engine.profiler.label = f"core{data_parallel_rank}"
        self.mirror = None
        self.service = EngineCoreService(self.plane, len(worker_addresses), data_parallel_rank)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=server_options(CORE_MAX_MESSAGE_BYTES),
                                      interceptors=[core_link.interceptor(core_secret)] if core_secret else [])
        cpb_grpc.add_EngineCoreServicer_to_server(self.service, self.server)
        # with a secret every caller is a front end, which checked its own caller's access:
        # the core's Admin then needs no loopback peer (an admin token is still checked)
        admin = AdminService(self.plane, admin_token, local_only=not core_secret,
                             enabled=bool(core_secret or admin_token or admin_insecure_loopback))
        apb_grpc.add_AdminServicer_to_server(admin, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._background = BackgroundTasks()
        self.plane.on_change.append(lambda: self._background.spawn(self._sync_health()))
        self.port = 0

    async def _sync_health(self) -> None:
        """Inference as the engine's readiness; the step watchdog's service NOT_SERVING while a
        data plane step hangs (``headrace serve`` then restarts the data plane)."""
        await set_health(self.health, self.engine.ready)
        await self.health.set(step_watchdog.HEALTH_SERVICE,
                              health_pb2.HealthCheckResponse.NOT_SERVING if self.engine.watchdog.hung
                              else health_pb2.HealthCheckResponse.SERVING)

    async def start(self, ready_timeout: float = 600.0) -> None:
        await set_health(self.health, False)
        await self.health.set(step_watchdog.HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.port = core_link.bind(self.server, self.address, self.tls)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.address}")
        await self.server.start()
        core_link.restrict(self.address)
        metrics = self.plane.metrics
        data_parallel = self.dp_size > 1 and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if data_parallel:
            self.mirror = dp_metrics.StateMirror(metrics, self.dp_rank)
            self.mirror.start()
        if self.metrics_port is not None:
            registry = dp_metrics.registry() if data_parallel else \
                multiprocess_registry(engine_state_collector(metrics))
            # a port in use fails start-up (net.PortInUse), as the API ports do
            self.metrics_port = metrics.serve(self.metrics_port, self.metrics_host, registry)
            log.info("control plane metrics on http://%s:%d/metrics", self.metrics_host,
                     self.metrics_port)
        log.info("engine core listening on %s; waiting for the data plane", self.address)
        await self.plane.start(ready_timeout)
        await set_health(self.health, self.engine.ready)

    async def stop(self, grace: float = 10.0) -> None:
        await set_health(self.health, False)
        await self.service.publisher.stop()
        if self.mirror is not None:
            await self.mirror.stop()
        await self.plane.stop()
        await self.server.stop(grace)
