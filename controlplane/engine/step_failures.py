"""A step the data plane reports it raised (``StepResult.error``) is not an outage: the worker is
there, one of the step's sequences may be what makes it raise (a request the sampler chokes
on), or the worker may be broken for everyone. ``StepFailures`` works out which, for the
engine (``headrace.controlplane.engine.loop``), and fails only the requests that cause it.

An episode starts with a failed step. Every step in flight is lost and the workers forgot every
sequence, so the engine opens fresh streams and every sequence waits to be recomputed
(``Scheduler.reset``), as after a lost data plane, but health stays SERVING. Then groups of the
failed step's sequences are tested apart, every other sequence held out of the scheduler
meanwhile (``Status.HELD``; requests that arrive are held too): a group passes when each of its
sequences got a new token (or finished), fails when a step of it raises.

1. The failed step's sequences again, together (the retry). Passes: a transient error, the
   episode ends.
2. Fails: the step's new sequences (first scheduled in it: a request that just arrived is the
   likeliest cause) apart from the others, then halves of a failing group, down to one sequence.
3. One sequence fails alone: its request fails with INTERNAL naming the error class, once the
   worker has shown it can run steps without it (a group passed in this episode, else a
   canary: a one-token request of the engine's own). The episode ends: everyone else resumes.
4. The canary fails too (or no culprit is found three episodes in a row within a minute): the
   worker is broken. Health is NOT_SERVING with the reason; after a back-off that doubles (1 s
   to 30 s) the canary is tried alone; requests held longer than ``outage_deadline_s`` since
   the trouble began fail with UNAVAILABLE; new ones are refused meanwhile. No request waits
   forever without a status.
"""

from __future__ import annotations

import collections
import logging
import time

import grpc

from headrace.controlplane.requests.request import Failure, Request, Sequence, Status
from headrace.controlplane.engine.worker_client import WorkerError
from headrace.worker.v1 import worker_pb2 as wpb

log = logging.getLogger("headrace.engine")
BACKOFF_S = (1.0, 30.0)        # the broken worker's canary retries: first, longest
FLAKY_EPISODES, FLAKY_WINDOW_S = 3, 60.0   # episodes without a culprit that make a worker broken
STABLE_S = 60.0                # without a failure this long, the back-off starts over


class StepFailed(Exception):
    """A result reported that a step raised: ``error`` (which step, what), ``steps`` the
    scheduled steps that were in flight (the oldest first)."""

    def __init__(self, error: wpb.StepError, steps: list):
        super().__init__(f"step {error.step_id} raised {error.error_class}")
        self.error, self.steps = error, steps

    def suspects(self) -> tuple[list[Sequence], list[Sequence]]:
        """(sequences of the step that raised, those of them new in it); every sequence in
        flight when that step is not found or empty."""
        step = next((s for i, s in self.steps if i == self.error.step_id), None)
        if step is None or step.empty:
            seqs = {id(s): s for _, st in self.steps for s, _ in st.scheduled()}
            return list(seqs.values()), []
        return [s for s, _ in step.scheduled()], [n.seq for n in step.new]


class _CanaryText:
    has_stop = False

    @staticmethod
    def add(token_id: int) -> bool:
        return False


class StepFailures:
    def __init__(self, engine, clock=time.monotonic):
        self.engine = engine
        self.clock = clock
        self.reason: str | None = None        # the worker is broken: health NOT_SERVING
        self.group: list[Sequence] | None = None   # being tested
        self._marks: dict[int, int] = {}      # seq id -> its tokens when its test began
        self._queue: list[list[Sequence]] = []    # groups still to test, the next first
        self._held: list[Sequence] = []       # kept out of the scheduler meanwhile
        self._held_requests: list[Request] = []   # arrived meanwhile (queued once it ends)
        self._candidates: list[Sequence] = []     # failed alone, before any group passed
        self._passes = 0
        self._retrying: tuple | None = None   # (suspects, new ones) while they are retried together
        self._error: wpb.StepError | None = None
        self.canary: Request | None = None
        self._canaries = 0
        self._flaky: collections.deque[float] = collections.deque()
        self._backoff = 0.0
        self._retry_at = 0.0
        self._trouble_since: float | None = None   # the first failure of this run of them
        self._last_failure = 0.0
        self.culprits = 0                     # requests failed as the cause (tests, metrics)

    @property
    def active(self) -> bool:
        """An episode is under way (or the worker is held to be broken)."""
        return self.group is not None or self.reason is not None

    # -- what the engine calls -------------------------------------------------------------
    def hold(self, request: Request) -> None:
        """A request submitted meanwhile waits until the episode ends."""
        for seq in request.sequences:
            seq.status = Status.HELD
        self._held_requests.append(request)

    async def step_failed(self, exc: StepFailed) -> None:
        engine, error = self.engine, exc.error
        suspects, new = exc.suspects()
        engine._inflight.fail(WorkerError(f"step {error.step_id} raised {error.error_class}"))
        engine.scheduler.reset()
        for seq in self._held:   # (as reset does to the waiting: their tokens in flight are lost)
            seq.num_inflight = seq.num_computed = 0
        await engine.workers.open()   # fresh streams: the workers start from an empty mirror
        now = self.clock()
        self._last_failure = now
        if self._trouble_since is None:
            self._trouble_since = now
        suspects = [s for s in suspects if not s.finished]
        if self.canary is not None and any(s.request is self.canary for s in suspects):
            self._broken(f"its steps fail ({error.error_class}) even for a one-token request")
        elif self.group is None:
            log.error("data plane step %d raised %s (%s); retrying its %d sequences apart",
                      error.step_id, error.error_class, error.message, len(suspects))
            self._error, self._passes, self._candidates = error, 0, []
            if not suspects:
                return self._end(culprit=False)
            self._queue = []
            self._retrying = (suspects, [s for s in new if not s.finished])
            self._test(suspects)
        else:
            self._group_failed()

    def check(self) -> None:
        """Each turn of the engine loop during an episode: a group that passed, the broken
        worker's next try and the deadline of the requests held."""
        now = self.clock()
        if self.reason is not None:
            self._fail_overdue(now)
            if self.canary is None and now >= self._retry_at:
                self._try_canary()
            elif self.canary is not None and self.canary.finished:
                self._recovered()
            return
        if self.canary is not None:
            if self.canary.finished:
                self.canary = None
                self._confirm()
            return
        group = self.group
        if group is not None and all(s.finished or len(s.output_token_ids) > self._marks[s.seq_id]
                                     for s in group):
            if not any(len(s.output_token_ids) > self._marks[s.seq_id] for s in group):
                self._retrying = None   # all left (aborted) before a step: no evidence either way
                return self._test_next()
            self._passes += 1
            if self._candidates:
                return self._confirm()
            if self._retrying is not None:   # the retry passed: a transient error
                return self._end(culprit=False)
            self._test_next()

    # -- an episode ------------------------------------------------------------------------
    @staticmethod
    def _split(group: list[Sequence], news: list[Sequence]) -> list[list[Sequence]]:
        if news and len(news) < len(group):
            olds = [s for s in group if s not in news]
            return [news, olds]
        half = (len(group) + 1) // 2
        return [group[:half], group[half:]]

    def _group_failed(self) -> None:
        group = [s for s in self.group if not s.finished]
        retried, self._retrying = self._retrying, None
        if retried is not None:   # the retry failed: now apart
            suspects, news = retried
            self._queue = self._split([s for s in suspects if not s.finished],
                                      [s for s in news if not s.finished])
        elif len(group) > 1:
            self._queue = self._split(group, []) + self._queue
        elif group:
            self._candidates.append(group[0])
            if self._passes:
                return self._confirm()
        self._test_next()

    def _test_next(self) -> None:
        while self._queue:
            group = [s for s in self._queue.pop(0) if not s.finished]
            if group:
                return self._test(group)
        if self._candidates:   # each failed alone and nothing passed: can the worker run at all?
            return self._start_canary()
        self._end(culprit=False)

    def _test(self, group: list[Sequence]) -> None:
        """Runs ``group`` alone: every other sequence is held."""
        sched = self.engine.scheduler
        self.group = group
        self._marks = {s.seq_id: len(s.output_token_ids) for s in group}
        keep = {id(s) for s in group}
        now = self.clock()
        for seq in group:   # (held while an earlier group was tested)
            if seq.status is Status.HELD:
                seq.status, seq.waiting_since = Status.WAITING, now
                sched.waiting.append(seq)
        self._held = [s for s in self._held if id(s) not in keep]
        for seq in list(sched.running):
            if id(seq) not in keep:
                sched.preempt(seq)
        out = [s for s in sched.waiting if id(s) not in keep]
        sched.waiting = [s for s in sched.waiting if id(s) in keep]
        for seq in out:
            seq.status = Status.HELD
        self._held.extend(out)
        self.engine._wake.set()

    def _confirm(self) -> None:
        """The candidates failed alone while the worker ran other steps: their requests fail."""
        error = self._error
        for seq in self._candidates:
            request = seq.request
            if request.finished or request.failure is not None:
                continue
            self.culprits += 1
            log.error("request failed: the data plane raised %s computing it (step %d); the other "
                      "requests go on", error.error_class, error.step_id,
                      extra={"request_id": request.request_id, "code": "INTERNAL"})
            self.engine.abort(request)
            request.fail(Failure(grpc.StatusCode.INTERNAL,
                                 f"the data plane failed computing this request ({error.error_class}); "
                                 "it was not completed"))
        self._end(culprit=True)

    def _end(self, culprit: bool) -> None:
        now = self.clock()
        if not culprit:
            self._flaky.append(now)
            while self._flaky and now - self._flaky[0] > FLAKY_WINDOW_S:
                self._flaky.popleft()
            if len(self._flaky) >= FLAKY_EPISODES:
                self._flaky.clear()
                return self._broken(f"{FLAKY_EPISODES} of its steps raised "
                                    f"({self._error.error_class if self._error else 'error'}) within "
                                    f"{FLAKY_WINDOW_S:g}s with no request to blame")
        self.group, self._queue, self._candidates, self._retrying = None, [], [], None
        self._trouble_since = None
        self._release()

    def _release(self) -> None:
        """The held sequences and requests go back to the scheduler."""
        sched, now = self.engine.scheduler, self.clock()
        for seq in self._held:
            if seq.status is Status.HELD:
                seq.status, seq.waiting_since = Status.WAITING, now
                sched.waiting.append(seq)
        for request in self._held_requests:
            if not request.finished and request.failure is None:
                for seq in request.sequences:
                    seq.status = Status.WAITING
                self.engine.scheduler.add(request.sequences)
        self._held, self._held_requests = [], []
        self.engine._wake.set()

    # -- the canary and a broken worker ----------------------------------------------------
    def _start_canary(self) -> None:
        """A one-token request of the engine's own, run alone: whether the worker can run a
        step at all without the candidates."""
        engine = self.engine
        self._canaries += 1
        canary = Request(request_id=f"headrace-canary-{self._canaries}")
        canary.internal = True
        token = (list(engine.info.eos_token_ids) or [0])[0] if engine.info is not None else 0
        canary.sequences = [Sequence(
            request=canary, seq_id=next(engine.seq_ids), index=0, prompt_token_ids=[token],
            sampling=wpb.Sampling(temperature=0, top_p=1, repetition_penalty=1), max_tokens=1,
            output=_CanaryText())]
        self.canary = canary
        self._test([])
        engine.scheduler.add(canary.sequences)
        self.group = canary.sequences
        self._marks = {canary.sequences[0].seq_id: 0}

    def _broken(self, why: str) -> None:
        now = self.clock()
        if self._trouble_since is None:
            self._trouble_since = now
        if self.canary is not None and not self.canary.finished:
            self.engine.scheduler.finish(self.canary.sequences[0], 0)
        self.canary = None
        self._test([])   # everyone waits, none is to blame
        self.group, self._queue, self._candidates, self._retrying = None, [], [], None
        if now - self._last_failure > STABLE_S or not self._backoff:
            self._backoff = BACKOFF_S[0]
        else:
            self._backoff = min(BACKOFF_S[1], self._backoff * 2)
        self._retry_at = now + self._backoff
        first = self.reason is None
        self.reason = f"the data plane is broken: {why}"
        log.error("%s; health NOT_SERVING, trying again in %.0fs (held requests fail after "
                  "%.0fs)", self.reason, self._backoff, self.engine.config.outage_deadline_s)
        if first:
            self.engine._health_changed()
        self.engine._wake_after(min(self._backoff, 1.0))

    def _try_canary(self) -> None:
        self._start_canary()

    def _recovered(self) -> None:
        self.canary = None
        self.reason = None
        self._trouble_since = None
        log.info("the data plane runs steps again; resuming %d held requests",
                 len({id(s.request) for s in self._held} | {id(r) for r in self._held_requests}))
        self.group = None
        self._release()
        self.engine._health_changed()

    def _fail_overdue(self, now: float) -> None:
        deadline = self.engine.config.outage_deadline_s
        if self._trouble_since is None or now - self._trouble_since <= deadline:
            self.engine._wake_after(1.0)
            return
        message = f"the data plane's steps keep failing for more than {deadline:g}s; retry later"
        failed = {}
        for seq in self._held:
            failed[id(seq.request)] = seq.request
        for request in self._held_requests:
            failed[id(request)] = request
        for request in failed.values():
            if not request.finished and request.failure is None:
                self.engine.abort(request)
                request.fail(Failure(grpc.StatusCode.UNAVAILABLE, message))
        self._held, self._held_requests = [], []
        self.engine._wake_after(1.0)
