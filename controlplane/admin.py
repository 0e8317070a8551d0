"""The ``headrace.v1.Admin`` service: live configuration, drain/resume, model reload and
on-demand profiling (``headrace.controlplane.engine.profiling``).

Access (``admin_access``, logged at start): with an admin token (``--admin-token`` or
``HEADRACE_ADMIN_TOKEN``) every call must carry ``authorization: Bearer <token>``
(UNAUTHENTICATED otherwise), from anywhere. Without one, Admin is disabled (every call
PERMISSION_DENIED): behind a local proxy or mesh sidecar every remote caller looks local, so
only a token can tell them apart. ``--admin-insecure-loopback`` opts back in to serving
callers on the loopback interface without a token, on a server bound to loopback or a unix
socket only (a server bound beyond loopback keeps Admin disabled).

``ReloadModel`` loads only directories under the allowed model roots (``--model-root``;
``headrace.controlplane.model_roots``), and refuses any other path with one message whether or not
it exists.
"""

from __future__ import annotations

import asyncio
import hmac
import time

import grpc

from headrace.common import net
from headrace.common.logs import get_logger
from headrace.controlplane.lora import api as lora_api
from headrace.controlplane import model_roots
from headrace.controlplane.scheduling.policy import POLICIES, Policy
from headrace.controlplane.engine.profiling import ProfileRefused
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.engine.worker_client import WorkerError
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc

log = get_logger("headrace.admin")

_LOCAL_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D", "unix:", "ipv6:[::ffff:127.")


def is_local_peer(peer: str) -> bool:
    return bool(peer) and peer.startswith(_LOCAL_PEERS)


def is_loopback_address(address: str) -> bool:
    """Whether a listening address (``host:port``, ``[v6]:port``, ``unix:path``) is reachable
    from this machine only."""
    parts = net.split_address(address)
    return parts is None or net.is_loopback(parts[0])


def admin_access(address: str, token: str | None, insecure_loopback: bool = False) -> bool:
    """Whether the Admin service is enabled on a server bound to ``address``; logs the rule."""
    if token:
        log.info("Admin service: every call needs the admin token")
        return True
    if insecure_loopback and is_loopback_address(address):
        log.warning("Admin service: loopback callers without a token (--admin-insecure-loopback)")
        return True
    why = f"{address} is bound beyond loopback" if insecure_loopback else "no admin token"
    log.warning(f"Admin service DISABLED: {why}; set --admin-token (or HEADRACE_ADMIN_TOKEN) to "
                "use Admin")
    return False


class AdminService(apb_grpc.AdminServicer):
    def __init__(self, plane, token: str | None = None, enabled: bool = True,
                 local_only: bool = True):
        """``local_only``: without a token, serve loopback callers only (an engine core whose
        callers are its own front ends, authenticated by the core secret, serves them all)."""
        self.plane = plane          # headrace.controlplane.server.ControlPlane
        self.token = token or None
        self.enabled = enabled
        self.local_only = local_only
        self._reload_lock = asyncio.Lock()

    # -- access ------------------------------------------------------------------------------
    async def _authorize(self, context) -> None:
        if not self.enabled:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the Admin service is disabled: the server has no admin token "
                                "(start it with --admin-token or HEADRACE_ADMIN_TOKEN)")
        if self.token is None:
            if self.local_only and not is_local_peer(context.peer()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "the Admin service is served to local callers only unless the "
                                    "server has an admin token (--admin-token)")
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                scheme, _, given = value.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                      self.token.encode()):
                    return
                break
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "Admin calls need 'authorization: Bearer <admin token>' metadata")

    # -- configuration -----------------------------------------------------------------------
    def config(self) -> apb.Config:
        plane, engine = self.plane, self.plane.engine
        cfg, sched = engine.config, engine.scheduler
        msg = apb.Config(model=plane.model_dir, max_queued=engine.max_queued,
                         prefix_cache=cfg.enable_prefix_cache, watermark=cfg.watermark,
                         workers=plane.workers.addresses, draining=engine.draining,
                         ready=engine.ready, in_flight_requests=len(engine.requests),
                         preemption_mode=cfg.preemption_mode,
                         kv_offloading_policy=cfg.kv_offloading_policy,
                         deterministic=cfg.deterministic)
        policy = sched.policy if sched is not None else cfg.policy
        msg.policy.name = policy.name
        if policy.aging_rate is not None:
            msg.policy.aging_rate = policy.aging_rate
        if policy.max_queue_delay is not None:
            msg.policy.max_queue_delay_s = policy.max_queue_delay
        if engine.info is not None:
            msg.model_name = engine.info.model_name
            msg.deterministic = engine.info.deterministic
            msg.max_model_len = engine.max_model_len
        if sched is not None:
            msg.max_running, msg.max_batched_tokens = sched.max_running, sched.max_batched_tokens
            msg.kv_block_size, msg.num_kv_blocks = sched.blocks.block_size, sched.blocks.num_blocks
            msg.num_host_kv_blocks = sched.blocks.host.num_blocks if sched.blocks.host else 0
            cost = sched.tier_cost
            if cost is not None:
                msg.host_load_seconds_per_token = cost.load_s_per_token or 0.0
                msg.recompute_seconds_per_token = cost.recompute_s_per_token or 0.0
                msg.host_hits_recomputed_tokens = cost.skipped_tokens
            msg.running, msg.waiting = len(sched.running), sched.num_queued
        else:
            msg.max_running, msg.max_batched_tokens = cfg.max_running, cfg.max_batched_tokens
        msg.worker_max_running, msg.worker_max_batched_tokens = self._worker_limits()
        return msg

    def _worker_limits(self) -> tuple[int, int]:
        infos = self.plane.workers.infos
        seqs = [i.max_num_seqs for i in infos if i.max_num_seqs]
        tokens = [i.max_batched_tokens for i in infos if i.max_batched_tokens]
        return (min(seqs) if seqs else 0), (min(tokens) if tokens else 0)

    async def GetConfig(self, request, context):
        await self._authorize(context)
        return self.config()

    async def UpdateConfig(self, request: apb.UpdateConfigRequest, context):
        await self._authorize(context)
        engine = self.plane.engine
        if engine.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        max_seqs, max_tokens = self._worker_limits()
        current = engine.scheduler.policy
        policy = None
        if request.HasField("policy") or request.HasField("aging_rate") or \
                request.HasField("max_queue_delay_s"):
            name = request.policy if request.HasField("policy") else current.name
            if name not in POLICIES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
            aging = current.aging_rate
            if request.HasField("aging_rate"):
                aging = None if request.aging_rate < 0 else request.aging_rate
            elif request.HasField("policy") and name != current.name:
                aging = None   # another policy's rate would mean other units
            delay = current.max_queue_delay
            if request.HasField("max_queue_delay_s"):
                delay = None if request.max_queue_delay_s == 0 else request.max_queue_delay_s
            try:
                policy = Policy(name, aging, delay)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        running = request.max_running if request.HasField("max_running") else None
        tokens = request.max_batched_tokens if request.HasField("max_batched_tokens") else None
        if running is not None and not 1 <= running <= (max_seqs or running):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_running must be in [1, {max_seqs}] (what the workers hold), got {running}")
        if tokens is not None and not 1 <= tokens <= (max_tokens or tokens):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_batched_tokens must be in [1, {max_tokens}] (the workers' "
                                f"warm-up size), got {tokens}")
        engine.reconfigure(policy=policy, max_running=running, max_batched_tokens=tokens)
        if request.HasField("max_queued"):
            engine.config.max_queued = request.max_queued
        self.plane.changed()   # the API front ends learn the new limits
        config = self.config()
        log.info("configuration changed", policy=config.policy.name,
                 aging_rate=config.policy.aging_rate if config.policy.HasField("aging_rate") else None,
                 max_queue_delay_s=config.policy.max_queue_delay_s
                 if config.policy.HasField("max_queue_delay_s") else None,
                 max_running=config.max_running, max_batched_tokens=config.max_batched_tokens,
                 max_queued=config.max_queued, peer=context.peer())
        return config

    # -- drain, resume, reload ---------------------------------------------------------------
    async def Drain(self, request: apb.DrainRequest, context):
        await self._authorize(context)
        if request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0")
        drained, in_flight, aborted = await self.plane.drain(request.timeout_s, request.abort_remaining)
        return apb.DrainResponse(drained=drained, in_flight=in_flight, aborted=aborted)

    async def Resume(self, request, context):
        await self._authorize(context)
        if self._reload_lock.locked():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a model reload is in progress")
        await self.plane.resume()
        return self.config()

    async def ReloadModel(self, request: apb.ReloadModelRequest, context):
        await self._authorize(context)
        if request.drain_timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s must be >= 0")
        if self._reload_lock.locked():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a model reload is already in progress")
        if self.plane.engine.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        if request.model and not model_roots.allowed(request.model, self.plane.model_roots):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, model_roots.refusal(request.model))
        async with self._reload_lock:
            model = request.model or self.plane.model_dir
            try:
                tokenizer = await asyncio.to_thread(ModelTokenizer, model)
                await asyncio.to_thread(lambda: tokenizer.max_token_bytes)   # off the loop
                await asyncio.to_thread(self.plane.requests.load_assets, model)   # its chat template
            except Exception as exc:  # noqa: BLE001 - a bad directory, on this plane
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"cannot load the tokenizer or chat template of {model!r}: {exc}")
            try:
                aborted, seconds = await self.plane.reload(model, tokenizer, request.drain_timeout_s)
            except WorkerError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"reload failed: {exc}")
            engine = self.plane.engine
            return apb.ReloadModelResponse(
                model=self.plane.model_dir, model_name=engine.info.model_name,
                num_kv_blocks=engine.scheduler.blocks.num_blocks,
                max_model_len=engine.max_model_len, aborted=aborted, seconds=seconds)


    # -- LoRA adapters (headrace.controlplane.lora.registry) ----------------------------------------------------
    async def LoadLoraAdapter(self, request: apb.LoadLoraAdapterRequest, context):
        await self._authorize(context)
        return await self._lora(context, "load", request.lora_name, request.lora_path)

    async def UnloadLoraAdapter(self, request: apb.UnloadLoraAdapterRequest, context):
        await self._authorize(context)
        if not 0 <= request.wait_s < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "wait_s must be >= 0")
        return await self._lora(context, "unload", request.lora_name, request.wait_s)

    async def ListLoraAdapters(self, request, context):
        await self._authorize(context)
        return lora_api.listing(self.plane.engine)

    async def _lora(self, context, what: str, name: str, arg):
        if self.plane.engine.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        try:   # (headrace.controlplane.lora.registry logs the change)
            return await lora_api.call_local(self.plane, what, name, arg)
        except lora_api.AdminError as exc:
            await context.abort(exc.code, exc.message)

    # -- profiling (headrace.controlplane.engine.profiling) --------------------------------------------------
    async def StartProfile(self, request: apb.StartProfileRequest, context):
        await self._authorize(context)
        if self.plane.engine.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        try:
            status = self.plane.engine.profiler.start(request.dir, request.num_steps)
        except ProfileRefused as exc:
            await context.abort(exc.code, str(exc))
        log.info("profiling started", dir=request.dir, num_steps=request.num_steps, peer=context.peer())
        return status

    async def StopProfile(self, request: apb.StopProfileRequest, context):
        await self._authorize(context)
        if not 0 <= request.wait_s < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "wait_s must be >= 0")
        try:
            return await self.plane.engine.profiler.stop(request.wait_s)
        except ProfileRefused as exc:
            await context.abort(exc.code, str(exc))


async def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True
