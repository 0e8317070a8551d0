"""The control plane's engine loop: schedule a step, send it to the workers, fold the sampled
tokens back into the sequences and stream each request's new tokens and text to its client.

Runs as one asyncio task. Handlers talk to it through ``submit`` and ``abort``; the engine
appends sampled tokens to the sequences and wakes their request (``Request.notify``); a
request that cannot go on gets a ``Failure``.

A request with a structured-output constraint reaches the scheduler once its grammar is compiled
(``headrace.controlplane.structured``, off the loop); each step then carries its constrained rows'
token bitmasks, and their matchers consume the tokens folded in.

A step the data plane reports it raised (``StepResult.error``) is not an outage:
``headrace.controlplane.engine.step_failures`` finds the requests that cause it and fails only those, or
holds everything while the worker is broken; ``headrace.controlplane.engine.step_watchdog`` marks the engine
unhealthy while a step takes far longer than any of its size before it and the data plane does
not answer (``healthy`` is the workers connected and neither of them in trouble).

Requests are woken after the next step is sent (the device is fed before clients are), except
in an engine core (``flush_woken``): there waking them is one message per front end, so while
another step is still in flight (the device stays busy) a folded step's news goes out first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import grpc

from headrace.common import failpoints
from headrace.controlplane.requests import limits
from headrace.controlplane.engine import sizing, speculation, step_codec
from headrace.controlplane.engine.config import EngineConfig
from headrace.controlplane.engine.outages import EngineOutages
from headrace.controlplane.engine.inflight import InFlightSteps
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.engine.profiling import Profiler
from headrace.controlplane.requests.request import Failure, Request, Sequence
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.controlplane.engine.step_failures import StepFailed, StepFailures
from headrace.controlplane.engine.step_watchdog import StepWatchdog
from headrace.controlplane.structured.outputs import StructuredOutputs
from headrace.controlplane.engine.telemetry import EngineTelemetry
from headrace.controlplane.engine.worker_client import WorkerError, WorkerGroup
from headrace.controlplane.engine import deterministic
from headrace.controlplane.lora.registry import LoraAdapters
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.engine")


class Engine(EngineOutages):
    def __init__(self, workers: WorkerGroup, config: EngineConfig,
                 telemetry: EngineTelemetry | None = None):
        self.workers = workers
        self.config = config
        self.telemetry = telemetry or EngineTelemetry()
        self.telemetry.metrics.bind(self)
        self.draining = False          # no new requests are admitted (Admin.Drain, reload)
        self.on_health_change = None   # callback when ``healthy`` changes
        self.info: wpb.WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0
        self.connected = False   # the workers' step streams are open (else: reconnecting)
        self._reported_healthy = (False, False)   # (healthy, watchdog.hung) as last told
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wake = asyncio.Event()
        workers.on_stream_end = self._wake.set   # an idle engine notices a data plane gone
        self._task: asyncio.Task | None = None
        self._outage_since: float | None = None
        self._to_wake: list[Request] = []   # requests with news, woken once the next step is sent
        self._inflight: InFlightSteps | None = None   # the loop's, new each time it starts
        # Admin StartProfile: one report per worker (an in-process group has one)
        self.profiler = Profiler(len(getattr(workers, "addresses", ())) or 1, wake=self._wake.set)
        # the engine core's: sends its front ends their news at once (one message each)
        self.flush_woken = None
        self.model_dir: str | None = None   # whose tokenizer grammars compile for (EnginePlane)
        self.structured = StructuredOutputs(config.structured_outputs_backend)
        self.lora = LoraAdapters(config.lora_modules, self)   # the LoRA adapters served (docs/lora.md)
        self.faults = StepFailures(self)      # steps the data plane reports it raised
        self.watchdog = StepWatchdog(self)    # steps that take far too long

    async def start(self, timeout: float = 600.0) -> None:
        self._build(await self.workers.describe(timeout))
        await self.workers.open()
        self._set_healthy(True)
        self._task = asyncio.create_task(self._loop(), name="headrace-engine")
        self.watchdog.start()

    def _build(self, infos: list[wpb.WorkerInfo]) -> None:
        """(Re)builds the KV block pool and the scheduler for what the workers serve."""
        if self.scheduler is not None:
            self.telemetry.metrics.retire(self.scheduler)
        deterministic.check_workers(self.config.deterministic, infos)
        self.info = infos[0]
        self.structured.configure(self.model_dir, self.info.vocab_size, self.info.eos_token_ids)
        self.scheduler, self.max_model_len = sizing.build_scheduler(self.config, infos,
                                                                    self.workers.num_kv_blocks)
        self.lora.configure(infos, self.workers, self._wake.set)
        self.scheduler.lora = self.lora if self.lora.enabled else None

    @property
    def deterministic(self) -> bool:
        """Batch-invariant serving (``--deterministic``): what the data planes run."""
        return self.info is not None and self.info.deterministic

    @property
    def max_queued(self) -> int:
        """Waiting sequences admitted at most (0: unbounded)."""
        if self.config.max_queued is not None:
            return self.config.max_queued
        running = self.scheduler.max_running if self.scheduler is not None else self.config.max_running
        return limits.default_max_queued(running)

    @property
    def ready(self) -> bool:
        """The model is loaded, the data plane answers and requests are admitted."""
        return self.healthy and not self.draining and self.scheduler is not None

    async def _stop_loop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def pause(self) -> None:
        """Stops the engine loop and the step streams (Admin reload; nothing in flight)."""
        await self._stop_loop()
        await self.workers.close_streams()
        self._set_healthy(False)

    async def restart(self, infos: list[wpb.WorkerInfo] | None) -> None:
        """Rebuilds for what the workers now serve and starts the loop again; with no
        ``infos`` (workers unreachable) keeps the scheduler and lets the loop reconnect."""
        if infos is None:
            self.scheduler.reset()
        else:
            self._build(infos)
            await self.workers.open()
            self._set_healthy(True)
        self._task = asyncio.create_task(self._loop(), name="headrace-engine")

    def abort_in_flight(self) -> int:
        """Ends every request with a last FINISH_REASON_ABORTED response (drain, reload);
        returns how many requests were ended."""
        requests = list(self.requests.values())
        for request in requests:
            self.abort(request)
            request.notify()
        return len(requests)

    def reconfigure(self, *, policy: Policy | None = None, max_running: int | None = None,
                    max_batched_tokens: int | None = None) -> None:
        """Live changes (kept across a reload); they take effect from the next step."""
        changes = dict(policy=policy, max_running=max_running, max_batched_tokens=max_batched_tokens)
        self.scheduler.reconfigure(**changes)
        for name, value in changes.items():
            if value is not None:
                setattr(self.config, name, value)
        self._wake.set()   # a larger cap or budget may let waiting work in

    def lora_refusal(self, name: str) -> tuple[grpc.StatusCode, str] | None:
        """Why a request for the LoRA adapter ``name`` cannot be served (None: it can)."""
        return self.lora.refusal(name)

    def lora_adapters(self) -> list[pb.LoraAdapter]:
        """The LoRA adapters served, as the public API lists them (``parent``: the caller's)."""
        return self.lora.listed()

    def submit(self, request: Request) -> None:
        if request.stream_interval <= 0:
            request.stream_interval = self.config.stream_interval
        if request.lora_name and not self.lora.attach(request):   # refused: it failed at once
            return
        self.requests[request.request_id] = request
        self.telemetry.request_submitted(request)
        if request.structured is not None:   # scheduled once its grammar is compiled
            self.structured.submit(request, self)
            return
        self.admit(request)

    def admit(self, request: Request) -> None:
        """Hands a submitted request's sequences to the scheduler (held while a failed step's
        sequences are tested apart)."""
        if self.faults.active:
            self.faults.hold(request)
        else:
            self.scheduler.add(request.sequences)
        self._wake.set()

    def abort(self, request: Request) -> None:
        """Client left (cancel, deadline): drop the request; its blocks are free at once."""
        for seq in request.sequences:
            if not seq.finished:
                self._finish(seq, pb.FINISH_REASON_ABORTED)
        if self.requests.pop(request.request_id, None) is not None:
            self.telemetry.request_done(request)
        self._wake.set()

    def finish_sequence(self, seq: Sequence, reason: int) -> None:
        """Ends one sequence (an API front end matched a stop string); its blocks are free."""
        self._finish(seq, reason)
        self._wake.set()

    async def stop(self) -> None:
        await self.watchdog.stop()
        await self._stop_loop()
        self.fail_all(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        await self.workers.close()

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for request in list(self.requests.values()):
            self.abort(request)
            request.fail(Failure(code, message))
        self.requests.clear()

    # -- the loop: schedule -> send -> fold results ----------------------------------------
    async def _loop(self) -> None:
        """Schedules and sends steps while ``InFlightSteps`` has room (overlapped scheduling:
        the device computes step N+1 while this process handles step N's tokens), then folds
        the oldest step's result; with room but nothing to schedule, an event (``_wake``)
        cuts that wait short. With nothing in flight and nothing to send it sleeps until an
        event can change that."""
        self._inflight = inflight = InFlightSteps(self.workers, self.telemetry,
                                                  self.config.pipeline_depth, self._step_ids, self.profiler)
        inflight.on_answer = self.watchdog.observe
        try:
            while True:
                if not self.connected:
                    self._wake_requests()
                    await self._reconnect()
                    continue
                try:
                    if failpoints.ACTIVE:
                        failpoints.hit("core.loop")
                    if self.faults.active:
                        self.faults.check()
                    step = None
                    # a speculating step runs alone: the sequences' tokens must all be known
                    speculate = self.scheduler.may_speculate()
                    room = inflight.has_room(self.scheduler.running) and not (speculate and inflight)
                    if room:
                        self._wake.clear()   # what happens from here on wakes the loop again
                        t0 = time.perf_counter()
                        step = self.scheduler.schedule(speculate)
                        if not step.empty:
                            masks = self.structured.step_masks(step, self.scheduler.speculation) \
                                if self.structured.live else None
                            await inflight.send(step, time.perf_counter() - t0, masks)
                            self.scheduler.after_step(step)
                            continue
                    self._wake_requests()   # after the send: the device is fed before clients are
                    if not inflight:
                        if self.profiler.pending_stop:   # idle workers hear it on an empty step
                            await inflight.flush()
                        else:
                            await self._idle(step)
                    elif not room or await inflight.result_ready(self._wake):
                        await self._fold_oldest()
                except WorkerError as exc:
                    self._workers_lost(exc)
                except StepFailed as exc:   # the worker is there: find what makes it raise
                    self._wake_requests()
                    await self.faults.step_failed(exc)
                except Exception as exc:   # a bug: its requests fail, the engine starts afresh
                    await self._loop_failed(exc)
        finally:
            inflight.close()

    async def _fold_oldest(self) -> None:
        sent, result = await self._inflight.receive()
        if result.HasField("error"):   # the step raised: every step in flight is lost
            raise StepFailed(result.error, [(sent.step_id, sent.step)] + self._inflight.in_flight())
        t2 = time.perf_counter()
        if sent.traced is not None or not sent.step.empty:
            emitted = self._fold(sent.step, result)
            self.telemetry.step_done(result, sent.traced, t2 - sent.at, time.perf_counter() - t2, emitted)
        late = await self._inflight.send_late_bitmask()   # the next step's, now that its tokens are in
        if self.flush_woken is not None and self._to_wake and self._inflight and not late:
            # a step still in flight keeps the device busy: the news goes out first (one loop
            # turn), then the next step is scheduled. Not after late bitmasks: the next step
            # goes first (the worker's forward pass of it waits for nothing else).
            self._wake_requests()
            self.flush_woken()
            await asyncio.sleep(0)

    def _fold(self, step: ScheduledStep, result: wpb.StepResult) -> int:
        """Applies the stop rules to a step's sampled tokens and queues the requests to wake;
        returns how many tokens reached their sequences."""
        stopped = set(result.stopped_seq_ids)   # the worker alone applies the stop-token rule
        if result.num_tokens:   # a speculating step: up to k+1 tokens per sequence
            return speculation.fold_verified(step, result, stopped, self._check,
                                             self.telemetry.first_token, self._settle,
                                             self.scheduler.verified)
        received = step_codec.decode(step, result)
        for seq in received:
            if len(seq.output_token_ids) == 1:
                self.telemetry.first_token(seq)
            self._settle(seq, self._check(seq, seq.seq_id in stopped))
        return len(received)

    def _check(self, seq: Sequence, stopped: bool) -> int:
        """The finish reason after ``seq``'s new last token; its grammar consumes the token."""
        reason = seq.check_stop(stopped, self.max_model_len)
        return reason if seq.grammar is None else self.structured.after_token(seq, reason)

    def _settle(self, seq: Sequence, reason: int) -> None:
        """Finishes ``seq`` for ``reason`` (UNSPECIFIED: it goes on) and queues its request to
        wake: at its end, at its first token (unless it asked for one message in all: TTFT
        waits for no interval, as in vLLM) and then once per stream_interval tokens."""
        if reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finish(seq, reason)
            self._to_wake.append(seq.request)
        else:
            interval = seq.request.stream_interval
            if len(seq.output_token_ids) - seq.delivered >= interval or (
                    not seq.delivered and interval < seq.max_tokens):
                self._to_wake.append(seq.request)

    async def _idle(self, step: ScheduledStep) -> None:
        """Nothing in flight and ``step``, just scheduled, empty. A step that only preempted
        changed the state: the next one admits again. Otherwise only an event changes what
        can run (a submit; an abort, drain or shutdown that frees blocks; a reconfigure), and
        each sets ``_wake``; time matters only to a policy that ages or bounds the queue delay
        (``Scheduler.retry_after``)."""
        if step.num_preempted:
            await asyncio.sleep(0)
            return
        self._wake.clear()
        if not self.workers.broken:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.scheduler.retry_after)
        if self.workers.broken:   # health NOT_SERVING now, not at the next request
            raise WorkerError("data plane closed its step stream")

    def _wake_requests(self) -> None:
        for request in self._to_wake:
            request.notify()
        self._to_wake.clear()

    def _finish(self, seq: Sequence, reason: int) -> None:
        self.structured.release(seq)
        self.scheduler.finish(seq, reason)
        if not getattr(seq.request, "internal", False):   # (not the step failures' canary)
            self.telemetry.seq_finished(seq, reason)
        if seq.request.finished and self.requests.pop(seq.request_id, None) is not None:
            self.telemetry.request_done(seq.request)
