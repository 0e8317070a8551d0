"""``headrace.core.v1.EngineCore``: the engine core's side of the front-end streams.

Each front end holds one ``Connect`` stream. Up come its submissions (validated, tokenised) and
aborts, which become ``CoreRequest``s in the engine. The engine appends sampled tokens to the
sequences as always and wakes requests with news (``Request.notify``); a ``CoreRequest`` wakes by
marking itself on its front end's ``FrontendLink``, and the link, once per batch of wake-ups (one
engine step), appends every new token of its requests to one pending ``Down`` message: column by
column for samples that run on (no message per sample and step), as a ``SeqDelta`` for a sample's
last tokens and for tokens with logprobs. The stream's sender takes the whole pending message when
gRPC lets it write, so a front end that reads slowly gets fewer, larger messages and the engine
never waits on it. When a stream ends (front end gone), every request it submitted is aborted:
blocks freed.

The core owns the queue and decides its bound: a submission of n samples is refused when n
more would pass ``--max-queued`` (taken one by one: several together cannot jointly pass it).
The front ends' early check reads ``Down.num_waiting``, pushed whenever the queue changes
(after submissions or aborts, a step's wake-ups, at least every ``QUEUE_PUSH_S``). Under data
parallelism each core owns its own queue and bound: a front end that places requests checks
the chosen core's.

Under data parallelism (several cores behind the front ends) a front end that places requests
(``Hello.placement``) also gets this core's load and prefix-cache changes
(``headrace.controlplane.core.load_publisher``), and a request may arrive here with the tokens its
samples had generated on a core that was lost (``Submit.resumed``): they are kept, their KV is
recomputed (through the prefix cache), and generation goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import structlog
from opentelemetry import trace

from headrace.common import tracing
from headrace.controlplane.requests import limits
from headrace.controlplane.core import load_publisher
from headrace.controlplane.core.link import CoreRequest, CoreText, FrontendLink, num_queued
from headrace.controlplane.requests.request import Sequence
from headrace.controlplane.service import model_info
from headrace.controlplane.structured import spec
from headrace.core.v1 import core_pb2 as cpb
from headrace.core.v1 import core_pb2_grpc as cpb_grpc
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.core")
QUEUE_PUSH_S = 0.25   # the queue length reaches every front end within this, whatever happens


class EngineCoreService(cpb_grpc.EngineCoreServicer):
    def __init__(self, plane, tensor_parallel_size: int = 1, data_parallel_rank: int = 0):
        self.plane = plane   # headrace.controlplane.core.plane.EnginePlane
        self.tp = tensor_parallel_size
        self.dp_rank = data_parallel_rank
        self.links: set[FrontendLink] = set()
        self.publisher = load_publisher.LoadPublisher(self)
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
                            default_stream_interval=engine.config.stream_interval,
                            unhealthy_reason=(engine.trouble or "") if engine.connected else "")
        if msg.loaded:
            msg.info.CopyFrom(engine.info)
            msg.model_info.CopyFrom(model_info(engine, self.tp))
        if getattr(engine, "lora", None) is not None:
            msg.lora_adapters.extend(engine.lora_adapters())
        return msg

    def broadcast_state(self) -> None:
        state = self.state()
        for link in self.links:
            link.push_state(state)

    async def Connect(self, request_iterator, context):
        link = FrontendLink(self.plane)
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
            self.publisher.leave(link)
            aborted = link.close()
            log.info("front end %d disconnected; aborted its %d requests", link.index, aborted)

    async def _read(self, request_iterator, link: FrontendLink) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for up in request_iterator:
                if up.HasField("hello"):
                    link.index = up.hello.frontend_index
                    log.info("front end %d connected (pid %d)", link.index, up.hello.pid)
                    if up.hello.placement:
                        link.placement = True
                        self.publisher.join(link)
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
            why = engine.trouble if engine.connected and engine.trouble else "loading or data plane down"
            return grpc.StatusCode.UNAVAILABLE, f"model is not ready ({why})"
        if not submit.resumed:   # (admitted before its core was lost: not refused now)
            refusal = limits.queue_refusal(engine.max_queued, engine.scheduler.num_queued, len(submit.sampling))
            if refusal:
                return refusal
        if submit.request_id in engine.requests:
            return grpc.StatusCode.INVALID_ARGUMENT, f"request_id {submit.request_id!r} is already in use"
        if not submit.sampling or len(submit.prompt_token_ids) + submit.max_tokens > engine.max_model_len:
            return grpc.StatusCode.INVALID_ARGUMENT, "request does not fit max_model_len (model reloaded?)"
        if submit.lora_name:   # (unloaded since the front end checked it)
            return engine.lora_refusal(submit.lora_name)
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
                          structured=constraint, lora_name=s.lora_name)
        prompt, text = list(s.prompt_token_ids), CoreText(s.has_stop_strings)
        req.sequences = [Sequence(request=req, seq_id=next(engine.seq_ids), index=i,
                                  prompt_token_ids=prompt, sampling=sampling, max_tokens=s.max_tokens,
                                  priority=s.priority, arrival=arrival, output=text)
                         for i, sampling in enumerate(s.sampling)]
        for seq, resumed in zip(req.sequences, s.resumed):   # moved here from a lost core
            seq.index, seq.output_token_ids = resumed.index, list(resumed.output_token_ids)
            seq.delivered = seq.text_fed = len(seq.output_token_ids)
        link.requests[s.handle] = req
        with contextlib.ExitStack() as stack:
            if self.tracer is not None and s.trace_context:
                req.span = self.tracer.start_span("headrace.core.request",
                                                  context=tracing.extract(dict(s.trace_context)),
                                                  attributes={"headrace.core": self.dp_rank,
                                                              "headrace.resumed": bool(s.resumed)})
                stack.enter_context(trace.use_span(req.span, end_on_exit=False))
            stack.enter_context(structlog.contextvars.bound_contextvars(
                request_id=s.request_id, trace_id=s.trace_id))
            engine.submit(req)

    def abort(self, link: FrontendLink, a: cpb.Abort) -> None:
        req = link.requests.get(a.handle)
        if req is None:
            return
        engine = self.plane.engine
        # (a resumed request holds only its unfinished samples: found by index, not position)
        seq = next((s for s in req.sequences if s.index == a.index), None)
        if a.reason == pb.FINISH_REASON_STOP_STRING and seq is not None:
            if not seq.finished:
                engine.finish_sequence(seq, pb.FINISH_REASON_STOP_STRING)
            seq.final_sent = True   # the front end has finished it
            if req.finished and all(s.final_sent for s in req.sequences):
                link.forget(req)
            return
        engine.abort(req)
        link.forget(req)
