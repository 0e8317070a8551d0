"""The engine half of a control plane: the engine and its data planes, the model's tokenizer
and assets (for Admin reload checks), drain / resume / reload, and a state-change callback.

Both the in-process ``headrace.controlplane.server.ControlPlane`` and the engine-core process
(``headrace.controlplane.core.server``) are built around one ``EnginePlane``; the Admin service
(``headrace.controlplane.admin``) acts on it."""

from __future__ import annotations

import contextlib
import logging
import time

import grpc

from headrace.controlplane import model_roots as roots
from headrace.controlplane.admin import wait_until
from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.metrics import ControlPlaneMetrics
from headrace.controlplane.requests.path import RequestPath
from headrace.controlplane.engine.telemetry import EngineTelemetry
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.engine.worker_client import WorkerError, WorkerGroup

log = logging.getLogger("headrace.controlplane")


class EnginePlane:
    """``on_change`` callbacks run (in the event loop) whenever readiness may have changed:
    data plane lost or back, drain, resume, reload."""

    def __init__(self, model_dir: str, worker_addresses: list[str], config: EngineConfig | None = None,
                 *, metrics: ControlPlaneMetrics | None = None, log_requests: bool = True,
                 log_prompts: bool = False, worker_credentials: grpc.ChannelCredentials | None = None,
                 worker_secret: str | None = None, chat_template: str | None = None,
                 generation_config: str = "auto", model_roots: list[str] | None = None,
                 **request_options):
        self.model_dir = model_dir
        # where Admin may reload a model from (``headrace.controlplane.model_roots``), fixed at start
        self.model_roots = roots.roots_for(model_dir, model_roots)
        self.model_roots_given = bool(model_roots)   # --model-root: runtime LoRA loads kept to it too
        self.tokenizer = ModelTokenizer(model_dir)
        self.metrics = metrics or ControlPlaneMetrics()
        self.workers = WorkerGroup(worker_addresses, worker_credentials, worker_secret)
        self.engine = Engine(self.workers, config or EngineConfig(),
                             EngineTelemetry(self.metrics, log_requests=log_requests))
        self.engine.model_dir = model_dir   # structured outputs compile for its tokenizer
        self.engine.on_health_change = self.changed
        self.engine.lora.on_change = self.changed   # (the front ends' adapter list)
        # ``request_options``: RequestPath's tenant tokens, trust_tenant_header, max_n, max_prompts
        self.requests = RequestPath(self.engine, model_dir, self.tokenizer, chat_template=chat_template,
                                    generation_config=generation_config, log_prompts=log_prompts,
                                    **request_options)
        self.on_change: list = []

    def changed(self) -> None:
        for callback in list(self.on_change):
            callback()

    async def start(self, ready_timeout: float = 600.0) -> None:
        await self.engine.start(ready_timeout)
        self.changed()
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
        self.changed()
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
        self.changed()

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
            self.changed()
            raise
        self.engine.model_dir = model
        await self.engine.restart(infos)
        self.model_dir, self.tokenizer = model, tokenizer
        self.requests.set_model(model, tokenizer)
        self.engine.draining = was_draining
        self.changed()
        seconds = time.monotonic() - start
        log.info("model %s loaded in %.1fs: %d KV blocks, max_model_len %d", infos[0].model_name,
                 seconds, self.engine.scheduler.blocks.num_blocks, self.engine.max_model_len)
        return aborted, seconds

    async def stop(self) -> None:
        self.engine.draining = True
        self.changed()
        await self.engine.stop()
        self.metrics.close()
