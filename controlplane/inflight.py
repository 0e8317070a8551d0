"""The steps the engine has sent and not yet had answered, oldest first: how many may be in
flight (pipeline depth) and the flush rule. A step the workers may hold back (no ``flush``)
is always followed by another, if need be an empty flushing one, so that every step's
result comes back. Profile commands (``controlplane.profiling``) ride on the steps sent."""

from __future__ import annotations

import collections
import itertools
import time
import typing

from controlplane import step_codec
from controlplane.profiling import Profiler
from controlplane.request import Sequence
from controlplane.step import ScheduledStep
from controlplane.telemetry import EngineTelemetry
from controlplane.worker_client import WorkerError, WorkerGroup
from headrace.dataplane.v1 import worker_pb2 as wpb


class Sent(typing.NamedTuple):
    step: ScheduledStep
    traced: object       # the step's tracing state (None when it is not traced)
    at: float            # time.perf_counter() when it was sent


class InFlightSteps:
    def __init__(self, workers: WorkerGroup, telemetry: EngineTelemetry, depth: int,
                 step_ids: itertools.count, profiler: Profiler | None = None):
        self.workers, self.telemetry = workers, telemetry
        self.profiler = profiler or Profiler(1)   # Admin StartProfile: commands ride on steps
        self.depth = max(1, depth)   # 1 = no overlap: each step is answered at once
        self._step_ids = step_ids
        self._sent: collections.deque[Sent] = collections.deque()
        self._last_flushed = True    # whether the newest step sent asked for its answer

    def __len__(self) -> int:
        return len(self._sent)

    def has_room(self, running: list[Sequence]) -> bool:
        """Whether another step may go out. Two in flight hide the device's step from this
        process's work; a third hides the gRPC round trip too, which decides latency at small
        batches. A finished sequence costs one slot per step sent before its last token came
        back, so beyond two only sequences whose end the worker can see itself may run: a
        sampled stop token (the worker then leaves them out of the steps it already holds) or
        max_tokens (never scheduled past). Stop strings match detokenized text here: while a
        running sequence has some, two steps at most."""
        n, depth = len(self._sent), self.depth
        if n and self._sent[-1].step.speculative:   # answered before anything else goes out
            return False
        if n < 2 or depth <= 2:
            return n < depth
        return n < depth and not any(s.output.has_stop for s in running)

    async def send(self, step: ScheduledStep, schedule_s: float) -> None:
        msg = step_codec.encode(step, next(self._step_ids), flush=self.depth == 1 or step.speculative)
        self.profiler.attach(msg)
        traced = self.telemetry.step_scheduled(step, msg, schedule_s, msg.step_id)
        await self.workers.send(msg)
        self._last_flushed = msg.flush
        self._sent.append(Sent(step, traced, time.perf_counter()))

    async def receive(self) -> tuple[Sent, wpb.StepResult]:
        """The oldest step and its result; flushes first when the workers hold it back."""
        if len(self._sent) == 1 and not self._last_flushed:
            await self.flush()
        result = await self.workers.receive()
        if result.profile_reports:
            self.profiler.received(result)
        return self._sent.popleft(), result

    async def flush(self) -> None:
        """Sends an empty step that makes the workers answer the one they hold back (and
        carries a pending profile command to them while the engine is idle)."""
        msg = step_codec.flush_request(next(self._step_ids))
        self.profiler.attach(msg)
        await self.workers.send(msg)
        self._last_flushed = True
        self._sent.append(Sent(ScheduledStep(), None, time.perf_counter()))

    def fail(self, exc: WorkerError) -> None:
        """The workers failed: every step in flight is lost."""
        for sent in self._sent:
            self.telemetry.step_failed(sent.traced, exc)
        self._sent.clear()
        self.profiler.lost(str(exc))
