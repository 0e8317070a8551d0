"""Progress of the data plane's start-up phases (weights, warm-up, KV cache, CUDA graphs): a
tqdm bar when stderr is a terminal (rank 0 only, so tensor-parallel ranks do not draw over
each other), otherwise log lines: one when a phase starts, one at most every ``interval``
seconds while it runs, and one with its duration when it ends. ``Phases`` keeps each phase's
duration for the ready line."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("headrace.dataplane")


class Progress:
    def __init__(self, phase: str, total: int, unit: str = "it", *, rank: int = 0,
                 interval: float = 5.0, stream=None):
        stream = stream or sys.stderr
        self.phase, self.total, self.unit, self.interval = phase, total, unit, interval
        self.done, self.start = 0, time.perf_counter()
        self._last_log = self.start
        self._bar = None
        if rank == 0 and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=phase, unit=unit, file=stream, leave=False)
        else:
            log.info("%s: 0/%d %s", phase, total, unit)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last_log >= self.interval and self.done < self.total:
            self._last_log = now
            log.info("%s: %d/%d %s (%.0f%%, %.1fs)", self.phase, self.done, self.total, self.unit,
                     100 * self.done / max(1, self.total), now - self.start)

    def close(self) -> float:
        """Ends the phase; returns its duration in seconds."""
        seconds = time.perf_counter() - self.start
        if self._bar is not None:
            self._bar.close()
        log.info("%s: %d %s in %.1fs", self.phase, self.done, self.unit, seconds)
        return seconds

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Phases:
    """Durations of the start-up phases, in order, for the ready line."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Ends ``phase`` now: it took the time since the previous mark."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._start
        self._start = now

    def summary(self) -> str:
        return ", ".join(f"{name} {s:.1f}s" for name, s in self.seconds.items())
