"""``CoreClient``: a front end's end of its ``EngineCore.Connect`` stream to the engine core.

It stands where the ``Engine`` stands for ``headrace.controlplane.requests.path`` (``submit``,
``abort``, ``requests``, readiness, the model's limits), so the request path, the gRPC service and
the HTTP API run unchanged in a front end. Requests keep their local ``Sequence``s: tokens coming
down are appended to them, stop strings are matched here (a match finishes the sample here and in
the core), and the client's handler builds its responses from them as in one process.

Submissions and aborts are batched into one ``Up`` message per event-loop turn. While the core
is unreachable ``healthy`` is False (NOT_SERVING) and new requests fail UNAVAILABLE; the stream
is opened again (``wait_for_ready``) as soon as the core answers. The requests it was serving
are kept (``headrace.controlplane.frontend.resume``): once the restarted core is ready each is submitted
again with the tokens its samples had (``Submit.resumed``), and its client's stream goes on
where it stopped, the same tokens as without the crash (greedy, or seeded: the noise is a
function of the seed and the token's index); one the core cannot take back, or that waits
longer than ``resume_deadline_s``, fails UNAVAILABLE. The stream goes over TLS and carries the
core secret as ``headrace.controlplane.core.security`` says.

Under data parallelism (``headrace.controlplane.frontend.router``, one client per core) the client
asks for the core's load and prefix-cache changes (``placement``) and keeps them (``core_load``,
``view``: what placement reads), and hands the requests of a lost core to ``on_lost`` (they resume
on another core) instead of failing them, as it offers it a request the core failed (``on_failed``:
one it could not serve may go on elsewhere)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import types

import grpc
import structlog
from opentelemetry import trace

from headrace.common import tracing
from headrace.common.logs import get_logger
from headrace.controlplane.core import security as core_link
from headrace.controlplane.kv.cache_summary import CacheView
from headrace.controlplane.frontend.down import DownMessages
from headrace.controlplane.frontend.resume import Parked
from headrace.controlplane.frontend.placement import load_score
from headrace.controlplane.requests.request import Failure, Request
from headrace.core.v1 import core_pb2 as cpb
from headrace.core.v1 import core_pb2_grpc as cpb_grpc

log = get_logger("headrace.frontend")
CORE_DOWN = "the engine core is unavailable (restarting?); retry"
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 5.0   # reconnect back-off (a refused secret must not spin)


class _QueueView:
    """The core's queue as it last pushed its length (on every change, ``Down.num_waiting``):
    what the request path's early queue check reads, in the scheduler's place."""

    __slots__ = ("num_queued",)

    def __init__(self):
        self.num_queued = 0


class CoreClient(DownMessages):
    def __init__(self, address: str, index: int, metrics, on_change=None, *,
                 credentials: grpc.ChannelCredentials | None = None, secret: str | None = None,
                 placement: bool = False, resume_deadline_s: float = 60.0):
        self.address, self.index, self.placement = address, index, placement
        self.parked = Parked(self, resume_deadline_s)   # kept through a core restart
        self.credentials, self.metadata = credentials, core_link.metadata(secret)
        self.telemetry = types.SimpleNamespace(metrics=metrics)
        self.config = types.SimpleNamespace(max_queued=0, stream_interval=1)
        self.on_change = on_change          # called when readiness or the model changed
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count(1)
        self.connected = False
        self.state = cpb.CoreState()
        self.info = None
        self.max_model_len = 0
        self.scheduler = None                # the queue's view while the model is loaded
        self._queue = _QueueView()
        self._by_handle: dict[int, Request] = {}
        self._handles = itertools.count(1)
        self._up = cpb.Up()
        self._up_ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.on_lost = None                  # called with the requests of a lost core
        self.on_failed = None                # (self, request, failure) -> True: it goes on elsewhere
        self.core_load = cpb.CoreLoad()      # (placement) the core's last report
        self.view = CacheView()              # (placement) what its prefix cache holds
        self.placed_since_report = 0
        # LoRA adapters through a core restart: what the lost core served ({name: path}), and
        # how to load them into its successor (the front end sets it: ``lora.api.restorer``)
        self.restore_adapters = None         # async ([(name, path)]) -> None
        self._lost_adapters: dict[str, str] | None = None
        self._restoring: asyncio.Task | None = None

    # -- what the request path reads -----------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.connected and self.state.healthy

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def max_queued(self) -> int:
        """The core's queue bound in waiting sequences (0: none), as last reported."""
        return self.state.max_queued

    @property
    def ready(self) -> bool:
        return self.healthy and not self.draining and self.scheduler is not None

    def lora_adapters(self) -> list:
        """The core's LoRA adapters, as it last pushed them (``CoreState.lora_adapters``)."""
        return list(self.state.lora_adapters)

    @property
    def trouble(self) -> str | None:
        """Why the core cannot serve (None: it can, or is loading)."""
        if not self.connected:
            return "the engine core is unavailable (restarting?)"
        return self.state.unhealthy_reason or None

    # -- what placement reads (headrace.controlplane.frontend.placement.Candidate) -----------
    @property
    def load(self) -> int:
        """The core's last reported load plus what was placed on it since, or at least this
        front end's own requests there."""
        reported = load_score(self.core_load.running, self.core_load.waiting)
        return max(reported + self.placed_since_report, len(self.requests))

    def match(self, hashes: list[int]) -> int:
        return self.view.match(hashes)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Request, resume: bool = False) -> None:
        """Sends ``request`` to the core; ``resume``: it comes from a lost core, with the
        tokens its unfinished samples generated there (``Submit.resumed``)."""
        handle = next(self._handles)
        request.core_handle = handle
        self.requests[request.request_id] = request
        self._by_handle[handle] = request
        self.placed_since_report += 1
        submit = getattr(request, "core_submit", None)
        if submit is None:   # its first core: the message, kept for a resumption
            seq0 = request.sequences[0]
            submit = request.core_submit = cpb.Submit(
                request_id=request.request_id, prompt_token_ids=seq0.prompt_token_ids,
                max_tokens=seq0.max_tokens, priority=seq0.priority,
                stream_interval=request.stream_interval, has_stop_strings=seq0.output.has_stop,
                tenant=request.tenant, lora_name=request.lora_name,
                trace_id=structlog.contextvars.get_contextvars().get("trace_id", ""))
            submit.sampling.extend(s.sampling for s in request.sequences)
            if request.structured is not None:
                submit.structured.CopyFrom(request.structured.to_proto())
            span = trace.get_current_span()
            if span.get_span_context().is_valid:
                submit.trace_context.update(tracing.inject(span))
        msg = self._up.submits.add()
        msg.CopyFrom(submit)
        msg.handle, msg.age = handle, time.monotonic() - request.arrival
        if resume:   # (a structured request's new matcher there consumes these tokens first)
            msg.ClearField("sampling")
            for seq in request.sequences:
                if not seq.finished:
                    msg.sampling.append(seq.sampling)
                    msg.resumed.add(index=seq.index, output_token_ids=seq.output_token_ids)
        self._up_ready.set()

    def take_requests(self) -> list[Request]:
        """Every request this client carries, forgotten here and aborted in the core (they
        move to another core)."""
        requests = list(self.requests.values())
        for request in requests:
            self.abort(request)
        return requests

    def abort(self, request: Request) -> None:
        """The client left (or its request ended): the core drops it, if it still runs."""
        self.parked.drop(request)
        if self.requests.pop(request.request_id, None) is None:
            return
        handle = getattr(request, "core_handle", None)
        self._by_handle.pop(handle, None)
        if not request.finished and self.connected:
            self._up.aborts.add(handle=handle)
            self._up_ready.set()

    # -- the stream ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"headrace-core-client-{self.index}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._lost()
        self.parked.fail_all(CORE_DOWN)

    async def _run(self) -> None:
        delay = RETRY_FIRST_S   # between attempts: doubles while they fail, reset once connected
        while True:
            try:
                async with core_link.channel(self.address, self.credentials) as channel:
                    # a fresh event per stream: an ended stream's sender must not take messages
                    self._up, self._up_ready = cpb.Up(), asyncio.Event()
                    ended = asyncio.Event()
                    call = cpb_grpc.EngineCoreStub(channel).Connect(
                        self._messages(self._up_ready, ended), metadata=self.metadata,
                        wait_for_ready=True)
                    try:
                        async for down in call:
                            if not self.connected:
                                self.connected = True
                                log.info("connected to the engine core", address=self.address)
                            self._apply(down)
                    finally:   # the call's sender ends too (a failed call leaves it waiting)
                        ended.set()
                        self._up_ready.set()
                        call.cancel()
            except grpc.aio.AioRpcError as exc:
                log.warning("engine core stream ended", code=exc.code().name, details=exc.details(),
                            retry_in_s=RETRY_FIRST_S if self.connected else delay)
            if self.connected:
                self._lost()
                delay = RETRY_FIRST_S
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, 2 * delay)

    async def _messages(self, ready: asyncio.Event, ended: asyncio.Event):
        yield cpb.Up(hello=cpb.Hello(frontend_index=self.index, pid=os.getpid(),
                                     placement=self.placement))
        while True:
            await ready.wait()
            ready.clear()
            if ended.is_set():
                return
            msg, self._up = self._up, cpb.Up()
            yield msg

    def _lost(self) -> None:
        """The core is gone (its blocks went with it, or it aborts them when it sees the stream
        end): every request waits for it to come back (``parked``), or resumes elsewhere
        (``on_lost``); when this front end stops, they fail UNAVAILABLE."""
        was = self.connected
        self.connected = False
        if was and self._lost_adapters is None:
            self._lost_adapters = {a.name: a.path for a in self.state.lora_adapters if not a.error}
        self._up = cpb.Up()
        self.view.clear()
        self.core_load, self.placed_since_report = cpb.CoreLoad(), 0
        requests = list(self.requests.values())
        self.requests.clear()
        self._by_handle.clear()
        if self.on_lost is not None and not self._stopping:
            self.on_lost(self, requests)
        elif not self._stopping:
            self.parked.keep(requests)
        else:
            for request in requests:
                request.fail(Failure(grpc.StatusCode.UNAVAILABLE, CORE_DOWN))
        if was and not self._stopping:
            log.error("lost the engine core; its requests wait for it", address=self.address,
                      requests=len(requests), resumed_elsewhere=self.on_lost is not None)
        if was:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _set_state(self, state: cpb.CoreState) -> None:
        model_changed = state.model_dir != self.state.model_dir and bool(self.state.model_dir)
        self.state = state
        self.config.max_queued = state.max_queued
        self.config.stream_interval = state.default_stream_interval
        if state.loaded:
            self.info, self.max_model_len = state.info, state.max_model_len
            self.scheduler = self._queue
        else:
            self.scheduler = None
        if model_changed:
            log.info("the engine core serves another model", model=state.model_dir)
            self.parked.fail_all("the engine core restarted with another model")
        if self.ready and self._lost_adapters is not None:
            self._restore([(n, p) for n, p in self._lost_adapters.items()
                           if n not in {a.name for a in state.lora_adapters}])
        if self.parked and self.ready and self._restoring is None:
            self.parked.resubmit()
        self._changed()

    def _restore(self, missing: list[tuple[str, str]]) -> None:
        """The restarted core lacks adapters the lost one served (loaded at run time): they
        are loaded again before the parked requests, some of which need them, go back."""
        self._lost_adapters = None
        if not missing or self.restore_adapters is None:
            return

        async def run():
            try:
                await self.restore_adapters(missing)
            except Exception as exc:  # noqa: BLE001 - their requests then fail NOT_FOUND, said once
                log.error("could not load the LoRA adapters again into the restarted core",
                          adapters=len(missing), error=type(exc).__name__)
            finally:
                self._restoring = None
            if self.parked and self.ready:
                self.parked.resubmit()

        self._restoring = asyncio.ensure_future(run())
