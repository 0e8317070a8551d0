"""Assembles the public gRPC server (Inference, Admin, grpc.health.v1 per service and
reflection, with deliberate message-size and keepalive settings, tracing and metrics
interceptors) and, in ``ControlPlane``, the whole control plane in one process: the public
servers, the OpenAI-compatible HTTP front end and the engine (``headrace.controlplane.core.plane``).

``headrace serve`` runs the engine core and the front ends as separate processes
(``headrace.controlplane.core.server``, ``headrace.controlplane.frontend.server``); ``ControlPlane``
is the in-process composition the tests and embedders use. The receive limit (and the HTTP body
limit) is the largest valid request of the model served (``headrace.controlplane.requests.limits``),
not a fixed size."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from headrace.common import net, security, tracing
from headrace.common.grpc_options import public_server_options
from headrace.controlplane.requests import limits, wire_check
from headrace.controlplane import reflection
from headrace.controlplane.admin import AdminService, admin_access, is_loopback_address
from headrace.controlplane.http.lora_routes import AdminAccess
from headrace.controlplane.lora.api import LoraAdmin
from headrace.controlplane.core.plane import EnginePlane
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.http.server import HttpFrontEnd, http_host
from headrace.controlplane.http.timeouts import HTTP_TIMEOUTS
from headrace.controlplane.lifecycle import (ADMIN, INFERENCE, BackgroundTasks, run_until_signal,
                                             set_health)
from headrace.controlplane.metrics import ControlPlaneMetrics, MetricsInterceptor
from headrace.controlplane.service import InferenceService
from headrace.controlplane.shutdown import end_streams
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger("headrace.controlplane")
def request_limits(model_dir: str, tokenizer, max_model_len: int | None) -> tuple[int, int]:
    """The largest valid gRPC request and HTTP body, in bytes, for this model: bounded by the text
    its context can need (``headrace.controlplane.requests.limits``), so an oversized call is
    refused before it costs memory."""
    context = limits.context_bound(model_dir, max_model_len)
    text = limits.max_text_bytes(context, tokenizer.max_token_bytes)
    return limits.max_request_bytes(text, context), limits.max_http_body_bytes(text, context)


def public_server(metrics: ControlPlaneMetrics, inference, admin, health_servicer, *,
                  api_token=None, shared_port: bool = False,
                  max_message_bytes: int) -> grpc.aio.Server:
    """The public gRPC server with its interceptors (tracing, bearer token, error counts) and
    services: ``inference`` (Inference), ``admin`` (Admin), health and reflection.
    ``api_token``: ``security.ApiTokens`` (or what ``security.as_tokens`` takes);
    ``shared_port``: bind with SO_REUSEPORT (API front ends), else exclusively;
    ``max_message_bytes``: the receive limit (``request_limits``)."""
    api_token = security.as_tokens(api_token)
    interceptors = [MetricsInterceptor(metrics, skip=(f"/{INFERENCE}/Generate",)),
                    wire_check.WireCheckInterceptor()]   # malformed bytes: INVALID_ARGUMENT
    if api_token:   # the Admin service checks its own token
        interceptors.insert(0, security.BearerTokenInterceptor(api_token, exempt=(f"/{ADMIN}/",)))
    provider = tracing.tracer_provider()
    if provider is not None:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        quiet = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
        interceptors.insert(0, aio_server_interceptor(tracer_provider=provider,
                                                      filter_=filters.negate(quiet)))
    options = public_server_options(max_message_bytes)
    if shared_port:
        options = [o for o in options if o != net.GRPC_EXCLUSIVE_PORT] + [net.GRPC_SHARED_PORT]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_InferenceServicer_to_server(inference, server)
    apb_grpc.add_AdminServicer_to_server(admin, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((INFERENCE, ADMIN, health.SERVICE_NAME), server)
    return server


def warn_if_open(address: str, tls, api_token: str | None) -> None:
    parts = net.split_address(address)
    if parts is not None and not net.is_loopback(parts[0]):
        log.warning("the API on %s is open to the network (%s, %s)", address,
                    "TLS" if tls else "plaintext", "API token required" if api_token else "no API token")


class ControlPlane:
    """The public server and its engine in one process. ``start`` returns once the model is
    ready (health SERVING when the workers have answered).

    ``metrics_port`` and ``http_port``: None serves none, 0 an ephemeral port (``self.metrics_port``
    / ``self.http.port`` tell which); ``metrics_host`` defaults to loopback. ``admin_token``,
    ``admin_insecure_loopback``: see ``headrace.controlplane.admin``; ``model_roots``: where Admin
    may reload a model from (``headrace.controlplane.model_roots``). ``api_token``: a token, a list
    of ``[TENANT=]TOKEN`` entries or ``security.ApiTokens``; ``trust_tenant_header``: take the
    tenant from ``x-headrace-tenant`` (a gateway in front sets it); ``http_timeouts``: the HTTP
    header and idle keep-alive timeouts in seconds; ``max_n``: the cap on the sequences of a request
    (n x prompts); ``max_prompts``: on the prompts of an HTTP body."""

    def __init__(self, model_dir: str, worker_addresses: list[str], address: str,
                 config: EngineConfig | None = None, *, metrics_port: int | None = None,
                 metrics_host: str | None = None, admin_token: str | None = None,
                 log_requests: bool = True, log_prompts: bool = False,
                 api_token=None, trust_tenant_header: bool = False,
                 max_n: int = limits.DEFAULT_MAX_N, max_prompts: int = limits.DEFAULT_MAX_PROMPTS,
                 tls: grpc.ServerCredentials | None = None,
                 worker_credentials: grpc.ChannelCredentials | None = None,
                 worker_secret: str | None = None, http_port: int | None = None,
                 chat_template: str | None = None, generation_config: str = "auto",
                 http_tls: tuple | None = None, metrics: ControlPlaneMetrics | None = None,
                 http_timeouts: tuple[float, float] = HTTP_TIMEOUTS,
                 admin_insecure_loopback: bool = False, model_roots: list[str] | None = None):
        self.core = EnginePlane(model_dir, worker_addresses, config, metrics=metrics,
                                log_requests=log_requests,
                                log_prompts=log_prompts, worker_credentials=worker_credentials,
                                worker_secret=worker_secret, chat_template=chat_template,
                                generation_config=generation_config,
                                tokens=security.as_tokens(api_token),
                                trust_tenant_header=trust_tenant_header, max_n=max_n,
                                max_prompts=max_prompts, model_roots=model_roots)
        self.metrics, self.workers, self.engine = self.core.metrics, self.core.workers, self.core.engine
        self.requests = self.core.requests
        self.tls, self.api_token = tls, api_token
        self.address = address
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or "127.0.0.1"
        self.health = health.aio.HealthServicer()
        tokens = security.as_tokens(api_token)
        self.max_message_bytes, max_body = request_limits(model_dir, self.core.tokenizer,
                                                          self.engine.config.max_model_len)
        self.inference = InferenceService(self.requests, len(worker_addresses))
        self.http = None if http_port is None else HttpFrontEnd(
            self.requests, http_host(address), http_port, tokens,
            tensor_parallel_size=len(worker_addresses), ssl=http_tls, max_body=max_body,
            header_timeout=http_timeouts[0], keep_alive_timeout=http_timeouts[1],
            lora_admin=AdminAccess(LoraAdmin(plane=self.core), admin_token,
                                   admin_insecure_loopback and is_loopback_address(address)))
        self.admin = AdminService(self.core, admin_token,
                                  enabled=admin_access(address, admin_token, admin_insecure_loopback))
        self.server = public_server(self.metrics, self.inference, self.admin, self.health,
                                    api_token=tokens, max_message_bytes=self.max_message_bytes)
        self.port = 0
        self._background = BackgroundTasks()
        self.core.on_change.append(lambda: self._background.spawn(self.sync_health()))

    @property
    def model_dir(self) -> str:
        return self.core.model_dir

    @property
    def tokenizer(self):
        return self.core.tokenizer

    async def sync_health(self) -> None:
        """Inference (and the server as a whole, "") is SERVING only while the model is
        loaded, the data plane answers and requests are admitted (not draining)."""
        await set_health(self.health, self.engine.ready)

    async def start(self, ready_timeout: float = 600.0) -> None:
        if self.metrics_port is not None:   # first: a port in use fails start-up (PortInUse)
            self.metrics_port = self.metrics.serve(self.metrics_port, self.metrics_host)
            log.info("control plane metrics on http://%s:%d/metrics", self.metrics_host, self.metrics_port)
        await self.sync_health()
        await self.health.set(ADMIN, health_pb2.HealthCheckResponse.SERVING)
        self.port = net.bind_exclusive(self.server, self.address,
                                       lambda server, address: security.bind(server, address, self.tls))
        await self.server.start()
        if self.http is not None:
            await self.http.start()
            log.info("OpenAI-compatible HTTP API on http://%s:%d", self.http.host, self.http.port)
        log.info("control plane listening on %s (requests up to %d bytes); waiting for the data "
                 "plane", self.address, self.max_message_bytes)
        warn_if_open(self.address, self.tls, self.api_token)
        await self.core.start(ready_timeout)
        await self.sync_health()

    async def drain(self, timeout: float, abort_remaining: bool = False) -> tuple[bool, int, int]:
        return await self.core.drain(timeout, abort_remaining)

    async def resume(self) -> None:
        await self.core.resume()

    async def stop(self, grace: float = 10.0) -> None:
        """Graceful: NOT_SERVING, refuse new calls, let open streams finish within ``grace``,
        then end each with a last event (``headrace.controlplane.shutdown``) and stop."""
        self.engine.draining = True
        await self.sync_health()
        await end_streams(self.requests, grace)
        if self.http is not None:
            await asyncio.gather(self.server.stop(1.0), self.http.stop(1.0))
        else:
            await self.server.stop(1.0)
        await self.core.stop()


async def serve_until_signal(model_dir: str, worker_addresses: list[str], address: str,
                             config: EngineConfig, grace: float = 10.0, stop_hook=None,
                             **options) -> None:
    """Runs a control plane (built inside the running event loop) until SIGINT/SIGTERM or
    ``stop_hook`` (see ``run_until_signal``); ``options`` go to ``ControlPlane``."""
    await run_until_signal(ControlPlane(model_dir, worker_addresses, address, config, **options),
                           grace, stop_hook)
