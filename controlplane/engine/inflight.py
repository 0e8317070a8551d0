"""The steps the engine has sent and not yet had answered, oldest first: how many may be in
flight (pipeline depth) and the flush rule. A step the workers may hold back (no ``flush``)
is always followed by another, if need be an empty flushing one, so that every step's
result comes back. A step without decodes (only prompt chunks: nobody else runs) is flushed:
the worker answers it once its device work is done instead of after launching the next step,
so a first token does not wait for that launch, and no decode's overlap is lost. While the
engine has nothing to schedule, ``result_ready`` waits for the oldest result or new work,
whichever comes first: a request submitted meanwhile is scheduled at once, not after it.
A step whose structured-output bitmasks depend on tokens still in flight goes out with
``bitmask_follows``; ``send_late_bitmask`` sends them once it is the oldest step in flight
(every token they depend on folded), before anything else. One more step may go out before
them (the worker prepares it meanwhile and launches it right after that sampling, so its
host work is off the constrained token's critical path); a second must wait. Profile
commands (``headrace.controlplane.engine.profiling``) ride on the steps sent."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
import typing

from headrace.common import stage_times
from headrace.controlplane.engine import step_codec
from headrace.controlplane.engine.profiling import Profiler
from headrace.controlplane.requests.request import Sequence
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.controlplane.engine.telemetry import EngineTelemetry
from headrace.controlplane.engine.worker_client import WorkerError, WorkerGroup
from headrace.worker.v1 import worker_pb2 as wpb


class Sent(typing.NamedTuple):
    step: ScheduledStep
    traced: object       # the step's tracing state (None when it is not traced)
    at: float            # time.perf_counter() when it was sent
    step_id: int = 0


class InFlightSteps:
    def __init__(self, workers: WorkerGroup, telemetry: EngineTelemetry, depth: int,
                 step_ids: itertools.count, profiler: Profiler | None = None):
        self.workers, self.telemetry = workers, telemetry
        self.profiler = profiler or Profiler(1)   # Admin StartProfile: commands ride on steps
        self.depth = max(1, depth)   # 1 = no overlap: each step is answered at once
        self._step_ids = step_ids
        self._sent: collections.deque[Sent] = collections.deque()
        self._last_flushed = True    # whether the newest step sent asked for its answer
        # [StepMasks, step id, steps sent after it] of each step sent with bitmask_follows whose
        # bitmasks are not sent yet, oldest first
        self._late: collections.deque[list] = collections.deque()
        self._result: asyncio.Task | None = None   # the oldest step's result, being read
        self.answered_at = time.perf_counter()     # when the last result came (the watchdog's)
        self.on_answer = None   # called with (step, seconds the worker took) per result

    def __len__(self) -> int:
        return len(self._sent)

    def has_room(self, running: list[Sequence]) -> bool:
        """Whether another step may go out. Two in flight hide the device's step from this
        process's work; a third hides the gRPC round trip too, which decides latency at small
        batches. A finished sequence costs one slot per step sent before its last token came
        back, so beyond two only sequences whose end the worker can see itself may run: a
        sampled stop token (the worker then leaves them out of the steps it already holds) or
        max_tokens (never scheduled past). Stop strings match detokenized text here: while a
        running sequence has some, two steps at most. A grammar ends its sequence on EOS (a
        stop token) or, rarely, here (a rejected token, EOS under ignore_eos): one slot at
        most. While a step waits for its bitmasks, one more step may go out, not two: the
        worker holds that one until the bitmasks come (``headrace.dataplane.pipeline``)."""
        n, depth = len(self._sent), self.depth
        if n and self._sent[-1].step.speculative:   # answered before anything else goes out
            return False
        if self._late and self._late[0][2] >= 1:
            return False
        if n < 2 or depth <= 2:
            return n < depth
        return n < depth and not any(s.output.has_stop for s in running)

    async def send(self, step: ScheduledStep, schedule_s: float, masks=None) -> None:
        """``masks``: the step's ``StepMasks`` (structured outputs), if it has constrained rows."""
        stages = stage_times.STAGES
        if stages is not None:
            scheduled = time.monotonic()
        flush = self.depth == 1 or step.speculative or not step.has_decodes
        msg = step_codec.encode(step, next(self._step_ids), flush=flush)
        self.profiler.attach(msg)
        for late in self._late:
            late[2] += 1
        if masks is not None:
            if masks.ready:
                masks.apply(msg)
            else:
                msg.bitmask_follows = True
                self._late.append([masks, msg.step_id, 0])
        traced = self.telemetry.step_scheduled(step, msg, schedule_s, msg.step_id)
        await self.workers.send(msg)
        if stages is not None:
            stages.stamp(f"step:{msg.step_id}", "scheduled", at=scheduled)
            stages.stamp(f"step:{msg.step_id}", "sent")
        self._last_flushed = msg.flush
        self._sent.append(Sent(step, traced, time.perf_counter(), msg.step_id))

    def in_flight(self) -> list[tuple[int, ScheduledStep]]:
        """(step id, step) of every step sent and not answered, the oldest first."""
        return [(s.step_id, s.step) for s in self._sent]

    def waiting_since(self) -> tuple[float, int, ScheduledStep] | None:
        """Since when (perf_counter) the workers owe the oldest step's answer (its send, or the
        answer before it, whichever came last), its id and the step; None with nothing in
        flight."""
        if not self._sent:
            return None
        oldest = self._sent[0]
        return max(oldest.at, self.answered_at), oldest.step_id, oldest.step

    async def send_late_bitmask(self) -> bool:
        """After a fold: the bitmasks of the step waiting for them, once it is the oldest step
        in flight (the tokens they depend on have all been folded). True when they went: the
        next step goes out now (the worker may hold that step's answer until it launches it)."""
        if not self._late or not self._sent or self._sent[0].step is not self._late[0][0].step:
            return False
        masks, step_id, _ = self._late.popleft()
        stages = stage_times.STAGES
        if stages is not None:
            stages.stamp(f"step:{step_id}", "late_fill")
        msg = wpb.StepRequest(step_id=step_id, late_bitmask=True)
        masks.fill(msg.bitmask)
        await self.workers.send(msg)
        if stages is not None:
            stages.stamp(f"step:{step_id}", "late_sent")
        # One loop turn: the stream's writer (gRPC's task) takes the bitmasks now, before the
        # next step is scheduled. The worker samples when they arrive and sends the token that
        # the next bitmasks need, while the next step only feeds a forward pass (that waits
        # for this sampling on the device anyway).
        await asyncio.sleep(0)
        return True

    async def _ask(self) -> None:
        """Flushes when the workers may hold the oldest step back (nothing sent after it)."""
        if len(self._sent) == 1 and not self._last_flushed:
            await self.flush()

    async def result_ready(self, event: asyncio.Event) -> bool:
        """Waits for the oldest step's result (True: ``receive`` has it at once) or for
        ``event`` (False), whichever comes first; the result keeps being read meanwhile."""
        if self._result is None:
            await self._ask()
            self._result = asyncio.ensure_future(self.workers.receive())
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait((self._result, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return self._result.done()

    async def receive(self) -> tuple[Sent, wpb.StepResult]:
        """The oldest step and its result; flushes first when the workers hold it back."""
        if self._result is not None:
            task, self._result = self._result, None
            result = await task
        else:
            await self._ask()
            result = await self.workers.receive()
        now = time.perf_counter()
        sent = self._sent.popleft()
        if self.on_answer is not None and not result.HasField("error"):
            self.on_answer(sent.step, now - max(sent.at, self.answered_at))
        self.answered_at = now
        if result.profile_reports:
            self.profiler.received(result)
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(f"step:{result.step_id}", "result", execute_ms=result.execute_ms,
                                     device_ms=result.device_ms, sample_ms=result.sample_ms,
                                     idle_ms=result.device_idle_ms)
        return sent, result

    async def flush(self) -> None:
        """Sends an empty step that makes the workers answer the one they hold back (and
        carries a pending profile command to them while the engine is idle)."""
        msg = step_codec.flush_request(next(self._step_ids))
        self.profiler.attach(msg)
        for late in self._late:
            late[2] += 1
        await self.workers.send(msg)
        self._last_flushed = True
        self._sent.append(Sent(ScheduledStep(), None, time.perf_counter(), msg.step_id))

    def close(self) -> None:
        """The loop ends: a result still being read is not awaited any more."""
        if self._result is not None:
            self._result.cancel()
            self._result = None

    def fail(self, exc: WorkerError) -> None:
        """The workers failed: every step in flight is lost."""
        self.close()
        for sent in self._sent:
            self.telemetry.step_failed(sent.traced, exc)
        self._sent.clear()
        self._late.clear()
        self.profiler.lost(str(exc))
