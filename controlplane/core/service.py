"""``headrace.core.v1.EngineCore``: the engine core's side of the front-end streams.

Each front end holds one ``Connect`` stream. Up come its submissions (validated, tokenised)
and aborts, which become ``CoreRequest``s in the engine. The engine appends sampled tokens to
the sequences as always and wakes requests with news (``Request.notify``); a ``CoreRequest``
wakes by marking itself on its front end's ``FrontendLink``, and the link, once per batch of
wake-ups (one engine step), appends every new token of its requests to one pending ``Down``
message: column by column for samples that run on (no message per sample and step), as a
``SeqDelta`` for a sample's last tokens and for tokens with logprobs. The stream's sender takes the whole pending message when gRPC lets it write, so a
front end that reads slowly gets fewer, larger messages and the engine never waits on it.
When a stream ends (front end gone), every request it submitted is aborted: blocks freed.

The core owns the queue and decides its bound: a submission of n samples is refused when n
more would pass ``--max-queued`` (taken one by one: several together cannot jointly pass it).
The front ends' early check reads ``Down.num_waiting``, pushed whenever the queue changes
(after submissions or aborts, a step's wake-ups, at least every ``QUEUE_PUSH_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc
import structlog
from opentelemetry import trace

from common import stage_times, tracing
from controlplane import limits
from controlplane.request import Request, Sequence, Status
from controlplane.service import model_info
from controlplane.structured import spec
from headrace.core.v1 import core_pb2 as cpb
from headrace.core.v1 import core_pb2_grpc as cpb_grpc
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.core")
QUEUE_PUSH_S = 0.25   # the queue length reaches every front end within this, whatever happens


class CoreText:
    """Stands in for ``OutputText`` in the core: the front end detokenises and matches stop
    strings; ``has_stop`` only keeps the pipeline at two steps (``InFlightSteps.has_room``)."""

    def __init__(self, has_stop: bool):
        self.has_stop = has_stop

    def add(self, token_id: int) -> bool:
        return False


@dataclasses.dataclass(eq=False)
class CoreRequest(Request):
    link: "FrontendLink | None" = None
    handle: int = 0
    span: object = None

    def notify(self) -> None:
        self.link.mark(self)


def num_queued(plane) -> int:
    """The engine's queued sequences (what ``--max-queued`` bounds); 0 before a model."""
    sched = plane.engine.scheduler
    return sched.num_queued if sched is not None else 0


def _columns() -> tuple[list[int], list[int], list[int], list[int]]:
    """Empty ``Down`` token columns: handles, sample indexes, counts, token ids."""
    return [], [], [], []


class FrontendLink:
    """One front end's stream: its requests by handle and the ``Down`` message being built."""

    def __init__(self, core: "EngineCoreService"):
        self.core = core
        self.index = -1
        self.requests: dict[int, CoreRequest] = {}
        self._dirty: dict[CoreRequest, None] = {}
        self._pending = cpb.Down()
        self._columns = _columns()   # the pending message's token columns, as lists
        self._ready = asyncio.Event()
        self._flush_scheduled = False
        self.closed = False
        self.sent_queued = -1   # the queue length this front end was last told

    def mark(self, request: CoreRequest) -> None:
        self._dirty[request] = None
        if not self._flush_scheduled:   # once all of this step's wake-ups are in
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_marked)

    def _flush_marked(self) -> None:
        if self._flush_scheduled:   # (not flushed meanwhile: ``EngineCoreService.flush``)
            self.flush()

    def fail(self, handle: int, code: grpc.StatusCode, message: str) -> None:
        self._pending.failed.add(handle=handle, code=code.value[0], message=message)
        self._ready.set()

    def push_state(self, state: cpb.CoreState) -> None:
        self._pending.state.CopyFrom(state)
        self._ready.set()

    def flush(self) -> None:
        """Appends the new tokens of every request woken since the last flush."""
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, {}
        if self.closed:
            return
        deltas, done = self._pending.deltas, []
        handles, indexes, counts, tokens = self._columns
        stages = stage_times.STAGES
        for req in dirty:
            if stages is not None and req.sequences[0].delivered == 0:   # its first tokens
                stages.stamp(req.request_id, "core_flushed")
            if req.failure is not None:
                self.fail(req.handle, req.failure.code, req.failure.message)
                done.append(req)
                continue
            over = True   # every sample finished (each then gets its last delta below)
            for seq in req.sequences:
                out, start = seq.output_token_ids, seq.delivered
                n, running = len(out), seq.status is not Status.FINISHED
                if running:
                    over = False
                    if start == n:
                        continue
                    if not seq.logprobs:   # the common case: a column entry
                        handles.append(req.handle)
                        indexes.append(seq.index)
                        counts.append(n - start)
                        tokens += out[start:n]
                        seq.delivered = n
                        continue
                elif seq.final_sent:
                    continue
                d = deltas.add(handle=req.handle, index=seq.index, token_ids=out[start:n])
                if seq.logprobs:
                    for token, (value, top_ids, top_values) in zip(d.token_ids, seq.logprobs[start:n]):
                        lp = d.logprobs.add(token_id=token, logprob=value)
                        for tid, val in zip(top_ids, top_values):
                            lp.top.add(token_id=tid, logprob=val)
                seq.delivered = n
                if not running:
                    seq.final_sent = True
                    d.finish_reason = seq.finish_reason
                    d.cached_prompt_tokens = seq.num_cached_prompt_tokens
            if over:
                done.append(req)
        for req in done:
            self.forget(req)
        self._ready.set()

    def forget(self, req: CoreRequest) -> None:
        if self.requests.pop(req.handle, None) is not None and req.span is not None:
            req.span.end()

    async def next_message(self) -> cpb.Down:
        """Everything pending, as one message (waits for something to send)."""
        await self._ready.wait()
        self._ready.clear()
        msg, self._pending = self._pending, cpb.Down()
        (handles, indexes, counts, tokens), self._columns = self._columns, _columns()
        if handles:
            msg.token_handles.extend(handles)
            msg.token_indexes.extend(indexes)
            msg.token_counts.extend(counts)
            msg.token_ids.extend(tokens)
        msg.num_waiting = self.sent_queued = num_queued(self.core.plane)
        return msg

    def note_queue(self, queued: int) -> None:
        """Sends the queue length (``queued``) if this front end does not know it yet."""
        if queued != self.sent_queued:
            self._ready.set()

    def close(self) -> int:
        """The front end is gone: aborts its requests (their blocks are free at once)."""
        self.closed = True
        engine, requests = self.core.plane.engine, list(self.requests.values())
        for req in requests:
            engine.abort(req)
            self.forget(req)
        return len(requests)


class EngineCoreService(cpb_grpc.EngineCoreServicer):
    def __init__(self, plane, tensor_parallel_size: int = 1):
        self.plane = plane   # controlplane.core.plane.EnginePlane
        self.tp = tensor_parallel_size
        self.links: set[FrontendLink] = set()
        self.tracer = tracing.get_tracer("headrace.core")
        plane.on_change.append(self.broadcast_state)
        plane.engine.flush_woken = self.flush

    def flush(self) -> None:
        """Every front end's news now (the engine woke its requests), and the queue length."""
        for link in self.links:
            if link._flush_scheduled:
                link.flush()
        self.note_queue()

    def note_queue(self) -> None:
        """Every front end learns the queue length where it changed."""
        queued = num_queued(self.plane)
        for link in self.links:
            link.note_queue(queued)

    async def _push_queue(self, link: FrontendLink) -> None:
        while True:
            await asyncio.sleep(QUEUE_PUSH_S)
            link.note_queue(num_queued(self.plane))

    def state(self) -> cpb.CoreState:
        plane, engine = self.plane, self.plane.engine
        msg = cpb.CoreState(healthy=engine.healthy, draining=engine.draining,
                            loaded=engine.scheduler is not None and engine.info is not None,
                            model_dir=plane.model_dir, max_model_len=engine.max_model_len,
                            max_queued=engine.max_queued,
                            default_stream_interval=engine.config.stream_interval)
        if msg.loaded:
            msg.info.CopyFrom(engine.info)
            msg.model_info.CopyFrom(model_info(engine, self.tp))
        return msg

    def broadcast_state(self) -> None:
        state = self.state()
        for link in self.links:
            link.push_state(state)

    async def Connect(self, request_iterator, context):
        link = FrontendLink(self)
        self.links.add(link)
        reader = asyncio.create_task(self._read(request_iterator, link))
        reader.add_done_callback(lambda _: link._ready.set())
        pusher = asyncio.create_task(self._push_queue(link))
        link.push_state(self.state())
        try:
            while not reader.done():
                msg = await link.next_message()
                if reader.done():
                    break
                yield msg
        finally:
            reader.cancel()
            pusher.cancel()
            self.links.discard(link)
            aborted = link.close()
            log.info("front end %d disconnected; aborted its %d requests", link.index, aborted)

    async def _read(self, request_iterator, link: FrontendLink) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for up in request_iterator:
                if up.HasField("hello"):
                    link.index = up.hello.frontend_index
                    log.info("front end %d connected (pid %d)", link.index, up.hello.pid)
                for submit in up.submits:
                    self.submit(link, submit)
                for abort in up.aborts:
                    self.abort(link, abort)
                self.note_queue()

    def _refusal(self, submit: cpb.Submit) -> tuple[grpc.StatusCode, str] | None:
        engine = self.plane.engine
        if engine.draining:
            return grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica"
        if not engine.healthy or engine.scheduler is None:
            return grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)"
        refusal = limits.queue_refusal(engine.max_queued, engine.scheduler.num_queued, len(submit.sampling))
        if refusal:
            return refusal
        if submit.request_id in engine.requests:
            return grpc.StatusCode.INVALID_ARGUMENT, f"request_id {submit.request_id!r} is already in use"
        if not submit.sampling or len(submit.prompt_token_ids) + submit.max_tokens > engine.max_model_len:
            return grpc.StatusCode.INVALID_ARGUMENT, "request does not fit max_model_len (model reloaded?)"
        return None

    def submit(self, link: FrontendLink, s: cpb.Submit) -> None:
        refusal = self._refusal(s)
        if refusal is not None:
            link.fail(s.handle, *refusal)
            return
        engine = self.plane.engine
        try:
            constraint = spec.from_proto(s.structured) if s.HasField("structured") else None
        except spec.ConstraintError as exc:
            link.fail(s.handle, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        arrival = time.monotonic() - s.age   # on this clock (the front end's may be another host's)
        req = CoreRequest(request_id=s.request_id, n=len(s.sampling), stream_interval=s.stream_interval,
                          arrival=arrival, link=link, handle=s.handle, tenant=s.tenant,
                          structured=constraint)
        prompt, text = list(s.prompt_token_ids), CoreText(s.has_stop_strings)
        req.sequences = [Sequence(request=req, seq_id=next(engine.seq_ids), index=i,
                                  prompt_token_ids=prompt, sampling=sampling, max_tokens=s.max_tokens,
                                  priority=s.priority, arrival=arrival, output=text)
                         for i, sampling in enumerate(s.sampling)]
        link.requests[s.handle] = req
        with contextlib.ExitStack() as stack:
            if self.tracer is not None and s.trace_context:
                req.span = self.tracer.start_span("headrace.core.request",
                                                  context=tracing.extract(dict(s.trace_context)))
                stack.enter_context(trace.use_span(req.span, end_on_exit=False))
            stack.enter_context(structlog.contextvars.bound_contextvars(
                request_id=s.request_id, trace_id=s.trace_id))
            engine.submit(req)

    def abort(self, link: FrontendLink, a: cpb.Abort) -> None:
        req = link.requests.get(a.handle)
        if req is None:
            return
        engine = self.plane.engine
        if a.reason == pb.FINISH_REASON_STOP_STRING and a.index < len(req.sequences):
            seq = req.sequences[a.index]
            if not seq.finished:
                engine.finish_sequence(seq, pb.FINISH_REASON_STOP_STRING)
            seq.final_sent = True   # the front end has finished it
            if req.finished and all(s.final_sent for s in req.sequences):
                link.forget(req)
            return
        engine.abort(req)
        link.forget(req)
