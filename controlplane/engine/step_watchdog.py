"""The step watchdog: notices within seconds a data plane that stopped answering steps (a stopped
or wedged process, a hung device), instead of the minute gRPC keepalive takes.

The engine knows when each step went out (``InFlightSteps.waiting_since``: since when the
workers owe the oldest step's answer) and how long steps of each size took before (the
longest per power-of-two bucket of tokens, ``observe``). Every ``INTERVAL_S`` the watchdog
compares: a step owed longer than ``step_timeout_floor_s`` and ``SLOW_FACTOR`` times the
longest of its size (extrapolated from smaller sizes, quadrupling per doubling, when its size
is new) is suspect, and the workers are asked for a health check:

- they answer: the step is slow but alive (a 30k-token prefill, a first Triton compilation):
  one log line, nothing else;
- they do not: **stalled**. Health NOT_SERVING with the reason (``reason``), one log line;
  requests keep waiting. The step's answer (SIGCONT) or the stream's end (kill) clears it.
- stalled for ``step_hang_timeout_s`` (or a step owed ``ALIVE_HANG_FACTOR`` times that while
  answering): **hung**. The engine core's health service ``HEALTH_SERVICE`` turns NOT_SERVING,
  which ``headrace serve``'s supervisor watches: it kills the data plane group and starts it
  again, and requests resume by recompute as after kill -9.

A step that took long while the workers did not answer is not learnt as its size's time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

log = logging.getLogger("headrace.engine")
HEALTH_SERVICE = "headrace.core.v1.StepWatchdog"   # the core's: NOT_SERVING while a step hangs
INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
SLOW_FACTOR = 8.0        # a step this many times the longest of its size is suspect
ALIVE_HANG_FACTOR = 10   # x step_hang_timeout_s: hung although the workers answer health checks


def bucket(tokens: int) -> int:
    return int(tokens).bit_length()


class StepWatchdog:
    def __init__(self, engine, clock=time.perf_counter):
        self.engine = engine
        self.clock = clock
        self.longest: dict[int, float] = {}   # bucket -> the longest answer of a step of it
        self.reason: str | None = None        # stalled: health NOT_SERVING
        self.hung = False                     # past the hang bound: serve restarts the data plane
        self._stalled_since: float | None = None
        self._slow_logged: int | None = None  # the step id last logged as slow
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="headrace-step-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def expected(self, tokens: int) -> float:
        """The longest a step of ``tokens`` took so far, or an estimate from other sizes (0:
        nothing known)."""
        b = bucket(tokens)
        if b in self.longest:
            return self.longest[b]
        smaller = [k for k in self.longest if k < b]
        if smaller:
            k = max(smaller)
            return self.longest[k] * 4.0 ** (b - k)
        larger = [self.longest[k] for k in self.longest if k > b]
        return min(larger, default=0.0)

    def observe(self, step, seconds: float) -> None:
        """A step was answered after the workers took ``seconds`` on it."""
        if self.reason is None and not step.empty:
            b = bucket(step.num_tokens)
            if seconds > self.longest.get(b, 0.0):
                self.longest[b] = seconds
        if self.reason is not None or self.hung:
            self._clear(f"the data plane answered again after {seconds:.1f}s")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL_S)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bug of its own
                log.exception("the step watchdog failed a check")

    async def check(self) -> None:
        engine, config = self.engine, self.engine.config
        inflight = engine._inflight
        owed = inflight.waiting_since() if inflight is not None and engine.connected else None
        if owed is None:
            return self._clear("no step is owed any more")
        since, step_id, step = owed
        now = self.clock()
        elapsed, expected = now - since, self.expected(step.num_tokens)
        if elapsed < max(config.step_timeout_floor_s, SLOW_FACTOR * expected):
            return self._clear(f"step {step_id} is within its time")
        alive = await engine.workers.alive(PROBE_TIMEOUT_S)
        now = self.clock()
        hang_s = config.step_hang_timeout_s
        if alive:
            self._stalled_since = None
            if self.reason is not None:
                self._clear("the data plane answers health checks again")
            if hang_s > 0 and now - since >= ALIVE_HANG_FACTOR * hang_s and not self.hung:
                self._hang(f"step {step_id} has run {now - since:.0f}s although the data plane "
                           f"answers health checks")
            elif self._slow_logged != step_id:
                self._slow_logged = step_id
                log.warning("data plane step %d (%d tokens) has run %.1fs, longest of its size so far "
                            "%.3fs; the data plane answers health checks: slow, not stalled",
                            step_id, step.num_tokens, now - since, expected)
            return
        if self._stalled_since is None:
            self._stalled_since = now
        if self.reason is None:
            self.reason = (f"a data plane step ({step.num_tokens} tokens) has not been answered for "
                           f"{now - since:.0f}s and the data plane does not answer health checks")
            log.error("%s (longest of its size so far %.3fs): health NOT_SERVING", self.reason, expected)
            engine._health_changed()
        if hang_s > 0 and now - self._stalled_since >= hang_s and not self.hung:
            self._hang(f"the data plane has not answered for {now - since:.0f}s")

    def _hang(self, why: str) -> None:
        self.hung = True
        self.reason = self.reason or why
        log.error("%s: the data plane is hung; its supervisor restarts it (requests resume by "
                  "recompute)", why)
        self.engine._health_changed()

    def _clear(self, why: str) -> None:
        self._stalled_since = None
        if self.reason is None and not self.hung:
            return
        log.info("step watchdog: %s; health SERVING again", why)
        self.reason, self.hung = None, False
        self.engine._health_changed()
