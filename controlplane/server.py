"""Assembles the control plane's gRPC server: Inference, Admin, grpc.health.v1 (per service)
and reflection, with deliberate message-size and keepalive settings, tracing and metrics
interceptors and the Prometheus exporter, and the OpenAI-compatible HTTP front end beside it; drains, resumes and reloads; runs until told to
stop. The receive limit (and the HTTP body limit) is the largest valid request of the model
served at start (``controlplane.limits``), not a fixed size."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import net, security, tracing
from common.grpc_options import PUBLIC_MAX_SEND_BYTES, server_options
from controlplane import limits, reflection
from controlplane.admin import AdminService, admin_access, wait_until
from controlplane.engine import Engine, EngineConfig
from controlplane.http.server import HttpFrontEnd, http_host
from controlplane.metrics import ControlPlaneMetrics, MetricsInterceptor
from controlplane.request_path import RequestPath
from controlplane.service import InferenceService
from controlplane.telemetry import EngineTelemetry
from controlplane.tokenizer import ModelTokenizer
from controlplane.worker_client import WorkerError, WorkerGroup
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("headrace.controlplane")

INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = apb.DESCRIPTOR.services_by_name["Admin"].full_name


class ControlPlane:
    """The public server and its engine. ``start`` returns once the port is bound; the
    model becomes ready (health SERVING) when the workers have answered.

    ``metrics_port`` and ``http_port``: None serves none, 0 an ephemeral port
    (``self.metrics_port`` / ``self.http.port`` tell which); ``metrics_host`` defaults to the
    API's host. ``admin_token``: see ``controlplane.admin``. ``api_token``: a token, a list of
    ``[TENANT=]TOKEN`` entries or ``security.ApiTokens``; ``trust_tenant_header``: take the
    tenant from ``x-headrace-tenant`` (a gateway in front sets it); ``max_n``: the cap on n."""

    def __init__(self, model_dir: str, worker_addresses: list[str], address: str,
                 config: EngineConfig | None = None, *, metrics_port: int | None = None,
                 metrics_host: str | None = None, admin_token: str | None = None,
                 log_requests: bool = True, log_prompts: bool = False,
                 api_token=None, trust_tenant_header: bool = False,
                 max_n: int = limits.DEFAULT_MAX_N, tls: grpc.ServerCredentials | None = None,
                 worker_credentials: grpc.ChannelCredentials | None = None,
                 worker_secret: str | None = None, http_port: int | None = None,
                 chat_template: str | None = None, generation_config: str = "auto",
                 http_tls: tuple | None = None, metrics: ControlPlaneMetrics | None = None):
        self.model_dir = model_dir
        self.tokenizer = ModelTokenizer(model_dir)
        self.metrics = metrics or ControlPlaneMetrics()
        self.workers = WorkerGroup(worker_addresses, worker_credentials, worker_secret)
        self.tls, self.api_token = tls, api_token
        self.engine = Engine(self.workers, config or EngineConfig(),
                             EngineTelemetry(self.metrics, log_requests=log_requests))
        self.engine.on_health_change = self._health_changed
        self.address = address
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or http_host(address)
        self.health = health.aio.HealthServicer()
        tokens = security.as_tokens(api_token)
        interceptors = [MetricsInterceptor(self.metrics, skip=(f"/{INFERENCE}/Generate",))]
        if tokens:   # the Admin service checks its own token
            interceptors.insert(0, security.BearerTokenInterceptor(tokens, exempt=(f"/{ADMIN}/",)))
        provider = tracing.tracer_provider()
        if provider is not None:
            from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

            quiet = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
            interceptors.insert(0, aio_server_interceptor(tracer_provider=provider,
                                                          filter_=filters.negate(quiet)))
        context = limits.context_bound(model_dir, self.engine.config.max_model_len)
        text = limits.max_text_bytes(context, self.tokenizer.max_token_bytes)
        self.max_message_bytes = limits.max_request_bytes(text, context)
        self.server = grpc.aio.server(options=server_options(self.max_message_bytes, PUBLIC_MAX_SEND_BYTES),
                                      interceptors=interceptors)
        self.requests = RequestPath(self.engine, model_dir, self.tokenizer, chat_template=chat_template,
                                    generation_config=generation_config, log_prompts=log_prompts,
                                    tokens=tokens, trust_tenant_header=trust_tenant_header, max_n=max_n)
        self.inference = InferenceService(self.requests, len(worker_addresses))
        self.http = None if http_port is None else HttpFrontEnd(
            self.requests, http_host(address), http_port, tokens,
            tensor_parallel_size=len(worker_addresses), ssl=http_tls,
            max_body=limits.max_http_body_bytes(text, context))
        pb_grpc.add_InferenceServicer_to_server(self.inference, self.server)
        self.admin = AdminService(self, admin_token, enabled=admin_access(address, admin_token))
        apb_grpc.add_AdminServicer_to_server(self.admin, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((INFERENCE, ADMIN, health.SERVICE_NAME), self.server)
        self.port = 0
        self._background: set[asyncio.Task] = set()

    async def sync_health(self) -> None:
        """Inference (and the server as a whole, "") is SERVING only while the model is
        loaded, the data plane answers and requests are admitted (not draining)."""
        status = (health_pb2.HealthCheckResponse.SERVING if self.engine.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", INFERENCE):
            await self.health.set(name, status)

    def _health_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self.sync_health())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def start(self, ready_timeout: float = 600.0) -> None:
        await self.sync_health()
        await self.health.set(ADMIN, health_pb2.HealthCheckResponse.SERVING)
        self.port = net.bind_exclusive(self.server, self.address,
                                       lambda server, address: security.bind(server, address, self.tls))
        await self.server.start()
        if self.http is not None:
            await self.http.start()
            log.info("OpenAI-compatible HTTP API on http://%s:%d", self.http.host, self.http.port)
        if self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(self.metrics_port, self.metrics_host)
                log.info("control plane metrics on http://%s:%d/metrics", self.metrics_host,
                         self.metrics_port)
            except OSError as exc:   # serve anyway: a taken metrics port must not stop inference
                log.error("cannot serve metrics on port %s: %s", self.metrics_port, exc)
                self.metrics_port = None
        log.info("control plane listening on %s (requests up to %d bytes); waiting for the data "
                 "plane", self.address, self.max_message_bytes)
        parts = net.split_address(self.address)
        if parts is not None and not net.is_loopback(parts[0]):
            log.warning("the API on %s is open to the network (%s, %s)", self.address,
                        "TLS" if self.tls else "plaintext",
                        "API token required" if self.api_token else "no API token")
        await self.engine.start(ready_timeout)
        await self.sync_health()
        log.info("model %s ready: %d KV blocks of %d tokens, max_model_len %d",
                 self.engine.info.model_name, self.engine.scheduler.blocks.num_blocks,
                 self.engine.info.block_size, self.engine.max_model_len)

    async def drain(self, timeout: float, abort_remaining: bool = False) -> tuple[bool, int, int]:
        """Stops admitting (NOT_SERVING, UNAVAILABLE to new requests) and waits up to
        ``timeout`` seconds for in-flight requests; then, if asked, aborts the rest cleanly
        (a last response with FINISH_REASON_ABORTED). Returns (drained, in flight, aborted)."""
        engine = self.engine
        if not engine.draining:
            engine.draining = True
            log.info("draining: %d requests in flight", len(engine.requests))
        await self.sync_health()
        drained = await wait_until(lambda: not engine.requests, timeout)
        aborted = 0
        if not drained and abort_remaining:
            aborted = engine.abort_in_flight()
            log.info("drain aborted %d requests after %.1fs", aborted, timeout)
            drained = not engine.requests
        return drained, len(engine.requests), aborted

    async def resume(self) -> None:
        if self.engine.draining:
            log.info("resuming: admitting requests again")
        self.engine.draining = False
        await self.sync_health()

    async def reload(self, model: str, tokenizer: ModelTokenizer,
                     drain_timeout: float) -> tuple[int, float]:
        """Drains (in-flight requests finish within ``drain_timeout``, then are aborted),
        reloads ``model`` on every worker, rebuilds the KV pool, scheduler and tokenizer, and
        resumes (unless a Drain was in force before). Returns (aborted, seconds)."""
        start, was_draining = time.monotonic(), self.engine.draining
        log.info("reloading model %s (was %s)", model, self.model_dir)
        _, _, aborted = await self.drain(drain_timeout, abort_remaining=True)
        await self.engine.pause()
        try:
            infos = await self.workers.reload(model)
        except WorkerError:
            # each worker put its previous model back (or is down): serve what they have
            infos = None
            with contextlib.suppress(WorkerError):
                infos = await self.workers.describe(timeout=30)
            await self.engine.restart(infos)
            self.engine.draining = was_draining
            await self.sync_health()
            raise
        await self.engine.restart(infos)
        self.model_dir, self.tokenizer = model, tokenizer
        self.requests.set_model(model, tokenizer)
        self.engine.draining = was_draining
        await self.sync_health()
        seconds = time.monotonic() - start
        log.info("model %s loaded in %.1fs: %d KV blocks, max_model_len %d", infos[0].model_name,
                 seconds, self.engine.scheduler.blocks.num_blocks, self.engine.max_model_len)
        return aborted, seconds

    async def stop(self, grace: float = 10.0) -> None:
        """Graceful: NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace``."""
        self.engine.draining = True
        await self.sync_health()
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace), self.http.stop(grace))
        else:
            await self.server.stop(grace)
        await self.engine.stop()
        self.metrics.close()


async def serve_until_signal(model_dir: str, worker_addresses: list[str], address: str,
                             config: EngineConfig, grace: float = 10.0, stop_hook=None,
                             **options) -> None:
    """Runs a control plane (built inside the running event loop) until SIGINT/SIGTERM, or
    until the function ``stop_hook`` is handed is called (from any thread); ``options`` go to
    ``ControlPlane``."""
    plane = ControlPlane(model_dir, worker_addresses, address, config, **options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if stop_hook is not None:
        stop_hook(lambda: loop.call_soon_threadsafe(stop.set))
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
