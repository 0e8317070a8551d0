"""An API front-end process (``headrace frontend --index N``): the public gRPC server
(Inference, Admin proxied to the core, health, reflection) and the OpenAI-compatible HTTP API,
with authentication and TLS, over a ``CoreClient``. Validation, tokenisation, chat templates,
detokenisation, stop strings and streaming run here (``headrace.controlplane.requests.path``).

Front ends share the public ports: each binds them with SO_REUSEPORT and the kernel spreads
connections over them (``headrace serve`` checks first that no other server holds the ports). Health
is SERVING only while the core is connected, ready and not draining. The link to the core is secured
as ``headrace.controlplane.core.security`` says (``core_credentials``: verify a TCP core's TLS
certificate; ``core_secret``: present the core's secret).

With several core addresses (``--data-parallel-size``) the front end places each request on
one of the cores (``headrace.controlplane.frontend.router``) and Admin calls reach every core."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2

from headrace.common import security
from headrace.controlplane.frontend.admin_proxy import AdminProxy
from headrace.controlplane.frontend.client import CoreClient
from headrace.controlplane.frontend.router import CoreRouter
from headrace.controlplane.frontend.placement import Placement
from headrace.controlplane.http.server import HttpFrontEnd, http_host
from headrace.controlplane.http.timeouts import HTTP_TIMEOUTS
from headrace.controlplane.metrics import ControlPlaneMetrics
from headrace.controlplane.requests.path import RequestPath
from headrace.controlplane.core import security as core_link
from headrace.controlplane.requests import limits
from headrace.controlplane.admin import admin_access, is_loopback_address
from headrace.controlplane.http.lora_routes import AdminAccess
from headrace.controlplane.lora.api import LoraAdmin, restorer
from headrace.controlplane.server import (ADMIN, BackgroundTasks, public_server, request_limits,
                                          set_health, warn_if_open)
from headrace.controlplane.service import NOT_READY, InferenceService
from headrace.controlplane.shutdown import end_streams
from headrace.controlplane.requests.tokenizer import ModelTokenizer

log = logging.getLogger("headrace.frontend")


class FrontEndInference(InferenceService):
    async def GetModelInfo(self, request, context):
        if not self.engine.healthy or not self.engine.state.loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        return self.engine.state.model_info


class FrontEnd:
    """``core_address``: the engine core (unix:PATH or host:port), or the data-parallel cores
    (a list, or comma-separated); ``placement``: how requests are placed on them."""

    def __init__(self, index: int, core_address: str, model_dir: str, address: str, *,
                 api_token: str | None = None, tls: grpc.ServerCredentials | None = None,
                 admin_token: str | None = None, http_port: int | None = None,
                 http_tls: tuple | None = None, chat_template: str | None = None,
                 generation_config: str = "auto", log_prompts: bool = False, reuse_port: bool = True,
                 trust_tenant_header: bool = False, max_n: int = limits.DEFAULT_MAX_N,
                 max_prompts: int = limits.DEFAULT_MAX_PROMPTS,
                 http_timeouts: tuple[float, float] = HTTP_TIMEOUTS,
                 admin_insecure_loopback: bool = False,
                 max_model_len: int | None = None,
                 core_credentials: grpc.ChannelCredentials | None = None,
                 core_secret: str | None = None, placement: Placement | None = None,
                 outage_deadline: float = 60.0, drain_timeout: float = 10.0):
        cores = core_address.split(",") if isinstance(core_address, str) else list(core_address)
        for core in cores:
            core_link.check(core, core_credentials is not None, core_secret)
        self.index, self.address, self.tls, self.api_token = index, address, tls, api_token
        tokens = security.as_tokens(api_token)
        self.metrics = ControlPlaneMetrics()
        self._background = BackgroundTasks()
        changed = lambda: self._background.spawn(self._core_changed())  # noqa: E731
        if len(cores) == 1:
            self.client = CoreClient(cores[0], index, self.metrics, on_change=changed,
                                     credentials=core_credentials, secret=core_secret,
                                     resume_deadline_s=outage_deadline)
        else:
            self.client = CoreRouter(cores, index, self.metrics, on_change=changed,
                                     credentials=core_credentials, secret=core_secret,
                                     placement=placement, resume_deadline_s=outage_deadline)
        self.drain_timeout = drain_timeout
        tokenizer = ModelTokenizer(model_dir)
        self.requests = RequestPath(self.client, model_dir, tokenizer,
                                    chat_template=chat_template, generation_config=generation_config,
                                    log_prompts=log_prompts, tokens=tokens,
                                    trust_tenant_header=trust_tenant_header, max_n=max_n,
                                    max_prompts=max_prompts)
        self.max_message_bytes, max_body = request_limits(model_dir, tokenizer, max_model_len)
        self.inference = FrontEndInference(self.requests)
        self.admin_channels = [core_link.channel(core, core_credentials) for core in cores]
        self.admin = AdminProxy(self.admin_channels, admin_token,
                                enabled=admin_access(address, admin_token, admin_insecure_loopback),
                                secret=core_secret)
        self.health = health.aio.HealthServicer()
        self.server = public_server(self.metrics, self.inference, self.admin, self.health,
                                    api_token=tokens, shared_port=reuse_port,
                                    max_message_bytes=self.max_message_bytes)
        admin_metadata = ([("authorization", f"Bearer {admin_token}")] if admin_token else []) + \
            self.admin.secret_metadata
        self.http = None if http_port is None else HttpFrontEnd(
            self.requests, http_host(address), http_port, tokens, ssl=http_tls, reuse_port=reuse_port,
            max_body=max_body, header_timeout=http_timeouts[0], keep_alive_timeout=http_timeouts[1],
            lora_admin=AdminAccess(LoraAdmin(stubs=self.admin.stubs, metadata=admin_metadata),
                                   admin_token, admin_insecure_loopback and is_loopback_address(address)))
        clients = self.client.clients if isinstance(self.client, CoreRouter) else [self.client]
        admin_of = dict(zip(cores, self.admin.stubs))
        for client in clients:   # a restarted core gets the lost one's runtime-loaded adapters
            client.restore_adapters = restorer(admin_of[client.address], admin_metadata)
        self.port = 0

    async def _core_changed(self) -> None:
        state = self.client.state
        if state.model_dir and state.model_dir != self.requests.model_dir:
            tokenizer = await asyncio.to_thread(ModelTokenizer, state.model_dir)
            self.requests.set_model(state.model_dir, tokenizer)
        await set_health(self.health, self.client.ready)

    async def start(self) -> None:
        await set_health(self.health, False)
        await self.health.set(ADMIN, health_pb2.HealthCheckResponse.SERVING)
        self.port = security.bind(self.server, self.address, self.tls)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.address}")
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        self.client.start()
        warn_if_open(self.address, self.tls, self.api_token)
        log.info("front end %d listening on %s%s", self.index, self.address,
                 f" and HTTP {self.http.host}:{self.http.port}" if self.http else "")

    async def stop(self, grace: float | None = None) -> None:
        """Ends every open stream as ``headrace.controlplane.shutdown`` says (``grace``: the drain
        timeout, default the front end's), then stops the servers."""
        await set_health(self.health, False)
        await end_streams(self.requests, self.drain_timeout if grace is None else grace)
        grace = 1.0
        stops = [self.server.stop(grace)] + ([self.http.stop(grace)] if self.http else [])
        await asyncio.gather(*stops)
        await self.client.stop()
        for channel in self.admin_channels:
            await channel.close()
