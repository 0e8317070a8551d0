"""``CoreClient``: a front end's end of its ``EngineCore.Connect`` stream to the engine core.

It stands where the ``Engine`` stands for ``controlplane.request_path`` (``submit``, ``abort``,
``requests``, readiness, the model's limits), so the request path, the gRPC service and the
HTTP API run unchanged in a front end. Requests keep their local ``Sequence``s: tokens coming
down are appended to them, stop strings are matched here (a match finishes the sample here and
in the core), and the client's handler builds its responses from them as in one process.

Submissions and aborts are batched into one ``Up`` message per event-loop turn. While the core
is unreachable every request fails UNAVAILABLE and ``healthy`` is False; the stream is opened
again (``wait_for_ready``) as soon as the core answers. The stream goes over TLS and carries the
core secret as ``controlplane.core_link`` says."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import types

import grpc
import structlog
from opentelemetry import trace

from common import tracing
from common.logs import get_logger
from controlplane import core_link
from controlplane.request import Failure, Request, Sequence, Status
from headrace.core.v1 import core_pb2 as cpb
from headrace.core.v1 import core_pb2_grpc as cpb_grpc
from headrace.v1 import inference_pb2 as pb

log = get_logger("headrace.frontend")
CORE_DOWN = "the engine core is unavailable (restarting?); retry"
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 5.0   # reconnect back-off (a refused secret must not spin)


class _QueueView:
    """The core's queue as it last pushed its length (on every change, ``Down.num_waiting``):
    what the request path's early queue check reads, in the scheduler's place."""

    __slots__ = ("num_queued",)

    def __init__(self):
        self.num_queued = 0


class CoreClient:
    def __init__(self, address: str, index: int, metrics, on_change=None, *,
                 credentials: grpc.ChannelCredentials | None = None, secret: str | None = None):
        self.address, self.index = address, index
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

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        handle = next(self._handles)
        request.core_handle = handle
        self.requests[request.request_id] = request
        self._by_handle[handle] = request
        seq0 = request.sequences[0]
        submit = self._up.submits.add(
            handle=handle, request_id=request.request_id, prompt_token_ids=seq0.prompt_token_ids,
            max_tokens=seq0.max_tokens, priority=seq0.priority,
            stream_interval=request.stream_interval, has_stop_strings=seq0.output.has_stop,
            age=time.monotonic() - request.arrival, tenant=request.tenant,
            trace_id=structlog.contextvars.get_contextvars().get("trace_id", ""))
        submit.sampling.extend(s.sampling for s in request.sequences)
        if request.structured is not None:
            submit.structured.CopyFrom(request.structured.to_proto())
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            submit.trace_context.update(tracing.inject(span))
        self._up_ready.set()

    def abort(self, request: Request) -> None:
        """The client left (or its request ended): the core drops it, if it still runs."""
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
        yield cpb.Up(hello=cpb.Hello(frontend_index=self.index, pid=os.getpid()))
        while True:
            await ready.wait()
            ready.clear()
            if ended.is_set():
                return
            msg, self._up = self._up, cpb.Up()
            yield msg

    def _lost(self) -> None:
        """The core is gone: every request fails UNAVAILABLE (its blocks went with the core, or
        the core aborts them when it sees the stream end)."""
        was = self.connected
        self.connected = False
        self._up = cpb.Up()
        requests = list(self.requests.values())
        self.requests.clear()
        self._by_handle.clear()
        for request in requests:
            request.fail(Failure(grpc.StatusCode.UNAVAILABLE, CORE_DOWN))
        if was and not self._stopping:
            log.error("lost the engine core", failed_requests=len(requests))
        if was:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _apply(self, down: cpb.Down) -> None:
        if down.HasField("state"):
            self._set_state(down.state)
        self._queue.num_queued = down.num_waiting
        woken, by_handle = {}, self._by_handle
        if down.token_handles:   # the columns first (a sample's deltas follow its columns)
            tokens, pos = list(down.token_ids), 0
            for handle, index, count in zip(down.token_handles, down.token_indexes, down.token_counts):
                request, end = by_handle.get(handle), pos + count
                if request is not None and index < len(request.sequences):
                    seq = request.sequences[index]
                    if seq.output.has_stop:
                        self._append(request, seq, tokens[pos:end])
                    elif seq.status is not Status.FINISHED:   # (as ``_append``, no stop strings)
                        seq.output_token_ids += tokens[pos:end]
                    woken[request] = None
                pos = end
        for d in down.deltas:
            request = by_handle.get(d.handle)
            if request is not None and d.index < len(request.sequences):
                self._append(request, request.sequences[d.index], d.token_ids, d)
                woken[request] = None
        for f in down.failed:
            request = self._by_handle.pop(f.handle, None)
            if request is not None:
                self.requests.pop(request.request_id, None)
                request.fail(Failure(_status(f.code), f.message))
        for request in woken:
            if request.finished:
                self._by_handle.pop(request.core_handle, None)
                self.requests.pop(request.request_id, None)
            request.notify()

    def _append(self, request: Request, seq: Sequence, token_ids, d: cpb.SeqDelta | None = None) -> None:
        """Appends ``token_ids`` (a column entry's, or ``d``'s with its logprobs and finish)."""
        if seq.finished:   # stopped here by a stop string; the core's later tokens are dropped
            return
        out = seq.output_token_ids
        out.extend(token_ids)
        finish_reason = d.finish_reason if d is not None else pb.FINISH_REASON_UNSPECIFIED
        if d is not None and d.logprobs:
            seq.logprobs.extend((lp.logprob, [t.token_id for t in lp.top], [t.logprob for t in lp.top])
                                for lp in d.logprobs)
        if seq.output.has_stop:   # a stop token's own text is not matched (as in Sequence.check_stop)
            upto = len(out) - 1 if finish_reason == pb.FINISH_REASON_STOP else len(out)
            if seq._feed_text(upto):
                del out[seq.text_fed:]
                del seq.logprobs[seq.text_fed:]
                self._finish(seq, pb.FINISH_REASON_STOP_STRING)
                self._up.aborts.add(handle=request.core_handle, reason=pb.FINISH_REASON_STOP_STRING,
                                    index=seq.index)
                self._up_ready.set()
                return
        if finish_reason:
            seq.num_cached_prompt_tokens = d.cached_prompt_tokens
            self._finish(seq, finish_reason)

    @staticmethod
    def _finish(seq: Sequence, reason: int) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason

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
        self._changed()


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN
