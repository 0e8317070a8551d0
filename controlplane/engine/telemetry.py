"""The engine's telemetry hooks: Prometheus metrics, request log lines and (when
``headrace.common.tracing`` is on) the spans of each request and step. The client-facing latencies
(TTFT, inter-token, end-to-end) are not the engine's: the request path observes them where it hands
responses to the client (``headrace.controlplane.requests.stream_latency``), in a front end's
process when the engine runs in an engine core.

One trace per request: the gRPC server span of ``Generate`` (opentelemetry-instrumentation-
grpc, which honours the caller's ``traceparent``) has children ``headrace.queue`` (waiting
for admission, again after a preemption), one ``headrace.prefill`` per prefill chunk, and
``headrace.decode`` per sample (events ``first_token``, ``preempted``, ``finish``). An engine
step that serves sampled requests gets a ``headrace.step`` span: child of the first prefill
chunk it computes (else of the first decode it advances), linked to every other request
span it serves. Its context and the served spans' traceparents travel in the
``StepRequest`` to the data plane, whose ``headrace.dataplane.step`` span is its child and
links to the same request spans.
"""

from __future__ import annotations

import time

import structlog
from opentelemetry import trace
from opentelemetry.trace import Link

from headrace.common import stage_times
from headrace.common.logs import get_logger
from headrace.controlplane.metrics import ControlPlaneMetrics
from headrace.common.tracing import epoch_ns, get_tracer, inject, traceparent
from headrace.v1 import inference_pb2 as pb


# -- the engine's hooks ----------------------------------------------------------------------
FINISH_NAMES = {v: pb.FinishReason.Name(v).removeprefix("FINISH_REASON_").lower()
                for v in pb.FinishReason.values()}


class _Req:
    __slots__ = ("arrival", "trace_id", "first_sched", "first_token", "span")

    def __init__(self, arrival: float, trace_id: str):
        self.arrival = arrival
        self.trace_id = trace_id
        self.first_sched: float | None = None
        self.first_token: float | None = None
        self.span = None


class _SeqTrace:
    __slots__ = ("req", "queue", "chunk", "decode", "preemptions")

    def __init__(self, req: _Req):
        self.req = req
        self.queue = None        # open headrace.queue span
        self.chunk = None        # headrace.prefill span of the step in flight
        self.decode = None       # open headrace.decode span
        self.preemptions = 0

    def current(self):
        return self.chunk or self.decode or self.req.span


class EngineTelemetry:
    """What the engine calls at a few points of a request's and a step's life. Per step it
    costs O(1) plus O(requests admitted, started or finished in it) with tracing off."""

    def __init__(self, metrics: ControlPlaneMetrics | None = None, *, log_requests: bool = True):
        self.metrics = metrics or ControlPlaneMetrics()
        self.tracer = get_tracer("headrace.controlplane")
        self.log_requests = log_requests
        self.log = get_logger("headrace.requests")
        self._reqs: dict[str, _Req] = {}
        self._seqs: dict[int, _SeqTrace] = {}   # sequences of sampled requests (tracing on)

    # -- requests ----------------------------------------------------------------------------
    def request_submitted(self, request) -> None:
        """Called in the request handler's context (its span is the current one)."""
        trace_id = structlog.contextvars.get_contextvars().get("trace_id", "")
        st = self._reqs[request.request_id] = _Req(request.arrival, trace_id)
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(request.request_id, "core_received")
        if self.tracer is None:
            return
        span = trace.get_current_span()
        if not span.is_recording():
            return
        st.span = span
        seq0 = request.sequences[0]
        span.set_attributes({"headrace.request_id": request.request_id,
                             "headrace.prompt_tokens": len(seq0.prompt_token_ids),
                             "headrace.max_tokens": seq0.max_tokens, "headrace.n": request.n,
                             "headrace.priority": seq0.priority})
        if request.lora_name:
            span.set_attribute("headrace.lora_adapter", request.lora_name)
        for seq in request.sequences:
            self._seqs[seq.seq_id] = _SeqTrace(st)
        self._seqs[seq0.seq_id].queue = self.tracer.start_span(
            "headrace.queue", context=trace.set_span_in_context(span),
            start_time=epoch_ns(request.arrival))

    def first_token(self, seq) -> None:
        """A sequence sampled its first token (called once it is appended)."""
        st = self._reqs.get(seq.request_id)
        if st is None:
            return
        now = time.monotonic()
        if st.first_token is None:
            st.first_token = now
            if stage_times.STAGES is not None:   # (folded: just after its step's result)
                stage_times.STAGES.stamp(seq.request_id, "core_first_token", at=now)
            m = self.metrics
            if st.first_sched is not None:
                m.prefill.observe(now - st.first_sched)
            m.prompt_tokens.inc(len(seq.prompt_token_ids))
        if self._seqs:
            t = self._seqs.get(seq.seq_id)
            if t is not None:
                self._decode_span(t, seq).add_event("first_token", {"headrace.ttft_s": now - st.arrival})

    def _decode_span(self, t, seq):
        """The sequence's decode span, started by its first decode step or its first token,
        whichever comes first (with overlapped scheduling the step is sent before the token
        arrives)."""
        if t.decode is None:
            t.decode = self.tracer.start_span(
                "headrace.decode", context=trace.set_span_in_context(t.req.span),
                attributes={"headrace.index": seq.index})
        return t.decode

    def seq_finished(self, seq, reason: int) -> None:
        counter = self.metrics.finished.get(reason)
        if counter is not None:
            counter.inc()
        if self._seqs:
            t = self._seqs.pop(seq.seq_id, None)
            if t is not None:
                attrs = {"headrace.finish_reason": FINISH_NAMES.get(reason, str(reason)),
                         "headrace.completion_tokens": len(seq.output_token_ids)}
                for span in (t.queue, t.chunk):
                    if span is not None:
                        span.end()
                t.queue = t.chunk = None
                if t.decode is not None:
                    t.decode.add_event("finish", attrs)
                    t.decode.end()
                elif t.req.span is not None:
                    t.req.span.add_event("finish", attrs)

    def request_done(self, request) -> None:
        """Every sequence of the request finished (or it was aborted); once per request."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return
        now = time.monotonic()
        seqs = request.sequences
        aborted = any(s.finish_reason == pb.FINISH_REASON_ABORTED for s in seqs)
        prompt = len(seqs[0].prompt_token_ids)
        generated = sum(len(s.output_token_ids) for s in seqs)
        m = self.metrics
        if not aborted:
            if st.first_token is not None:
                m.decode.observe(now - st.first_token)
            m.prompt_len.observe(prompt)
            m.gen_len.observe(generated)
        if st.span is not None:
            st.span.set_attributes({"headrace.completion_tokens": generated,
                                    "headrace.cached_prompt_tokens": seqs[0].num_cached_prompt_tokens})
        if self.log_requests:
            self.log.info(
                "request finished", request_id=request.request_id, trace_id=st.trace_id,
                finish_reason=[FINISH_NAMES.get(s.finish_reason, "") for s in seqs]
                if len(seqs) > 1 else FINISH_NAMES.get(seqs[0].finish_reason, ""),
                prompt_tokens=prompt, completion_tokens=generated,
                cached_prompt_tokens=seqs[0].num_cached_prompt_tokens,
                **({"lora_adapter": request.lora_name} if request.lora_name else {}),
                preemptions=sum(s.num_preemptions for s in seqs),
                queue_s=None if st.first_sched is None else round(st.first_sched - st.arrival, 6),
                ttft_s=None if st.first_token is None else round(st.first_token - st.arrival, 6),
                e2e_s=round(now - st.arrival, 6))

    # -- steps -------------------------------------------------------------------------------
    def step_scheduled(self, step, msg, schedule_s: float, step_id: int):
        """After scheduling, before the step goes out; returns the step's tracing state."""
        self.metrics.step_schedule.observe(schedule_s)
        now = None
        for new in step.new:
            st = self._reqs.get(new.seq.request_id)
            if st is not None and st.first_sched is None:
                if now is None:
                    now = time.monotonic()
                st.first_sched = now
                self.metrics.queue.observe(now - st.arrival)
        if not self._seqs:
            return None
        return self._trace_step(step, msg, schedule_s, step_id)

    def _trace_step(self, step, msg, schedule_s: float, step_id: int):
        tracer, seqs = self.tracer, self._seqs
        new_ids = {r.seq.seq_id for r in step.new}
        chunks, served, parent = [], [], None
        for seq, n in step.scheduled():
            t = seqs.get(seq.seq_id)
            if t is None:
                continue
            req_ctx = trace.set_span_in_context(t.req.span)
            if seq.seq_id in new_ids:
                if t.queue is not None:
                    t.queue.end()
                    t.queue = None
                if seq.num_preemptions > t.preemptions:   # resumed after a preemption
                    t.preemptions = seq.num_preemptions
                    at = epoch_ns(seq.waiting_since)
                    (t.decode or t.req.span).add_event(
                        "preempted", {"headrace.generated_tokens": len(seq.output_token_ids)},
                        timestamp=at)
                    tracer.start_span("headrace.queue", context=req_ctx, start_time=at,
                                      attributes={"headrace.preempted": True}).end()
            decoding = (n == 1 and seq.num_computed == seq.num_total - 1
                        and (seq.num_inflight > 0 or bool(seq.output_token_ids)))
            if decoding:
                span = self._decode_span(t, seq)
            else:
                if t.chunk is not None:   # the previous chunk's step is still in flight
                    t.chunk.end()
                span = t.chunk = tracer.start_span(
                    "headrace.prefill", context=req_ctx,
                    attributes={"headrace.step_id": step_id, "headrace.tokens": n,
                                "headrace.position": seq.num_computed, "headrace.index": seq.index,
                                "headrace.cached_tokens": seq.num_cached_prompt_tokens,
                                "headrace.recompute": seq.num_preemptions > 0})
                chunks.append((t, span))
                if parent is None or parent[1]:
                    parent = (span, False)
            if parent is None:
                parent = (span, True)
            served.append(span.get_span_context())
        if parent is None:
            return None
        links = [Link(c) for c in served if c is not parent[0].get_span_context()]
        step_span = tracer.start_span(
            "headrace.step", context=trace.set_span_in_context(parent[0]), links=links,
            attributes={"headrace.step_id": step_id, "headrace.seqs": len(step.new) + len(step.running.seqs),
                        "headrace.new_seqs": len(step.new),
                        "headrace.schedule_ms": schedule_s * 1e3})
        msg.trace_context.update(inject(step_span))
        msg.trace_links.extend(traceparent(c) for c in served)
        return step_span, chunks

    def step_done(self, result, handle, roundtrip_s: float, process_s: float,
                  emitted: int) -> None:
        """``emitted``: the step's tokens that reached requests (a token sampled for a request
        that finished while the step was in flight is not counted)."""
        if stage_times.STAGES is not None:   # (its tokens folded: the late bitmasks go next)
            stage_times.STAGES.stamp(f"step:{result.step_id}", "folded")
        m = self.metrics
        execute_s = result.execute_ms / 1e3
        m.step_execute.observe(execute_s)
        if result.device_ms:
            m.step_device.observe(result.device_ms / 1e3)
        if result.seq_ids:   # a step that sampled
            m.step_sample.observe(result.sample_ms / 1e3)
        m.step_transport.observe(max(0.0, roundtrip_s - execute_s))
        m.step_process.observe(process_s)
        if result.swap_ms or result.swap_out_bytes or result.swap_in_bytes:
            m.offload_seconds.inc(result.swap_ms / 1e3)
            m.offload_out.inc(result.swap_out_bytes)
            m.offload_in.inc(result.swap_in_bytes)
        if emitted:
            m.generation_tokens.inc(emitted)
        if handle is not None:
            step_span, chunks = handle
            self._end_chunks(chunks)
            step_span.set_attributes({"headrace.execute_ms": result.execute_ms,
                                      "headrace.device_ms": result.device_ms,
                                      "headrace.device_idle_ms": result.device_idle_ms,
                                      "headrace.sample_ms": result.sample_ms,
                                      "headrace.transport_ms": max(0.0, roundtrip_s - execute_s) * 1e3,
                                      "headrace.sampled_tokens": emitted})
            step_span.end()

    def step_failed(self, handle, error: Exception) -> None:
        if handle is not None:
            step_span, chunks = handle
            self._end_chunks(chunks)
            step_span.record_exception(error)
            step_span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            step_span.end()

    @staticmethod
    def _end_chunks(chunks) -> None:
        """Ends the prefill-chunk spans a step carried (once: a later chunk may end one first)."""
        for t, span in chunks:
            if t.chunk is span:
                span.end()
                t.chunk = None
