"""What the engine loop does when it cannot go on: the data plane is lost (its requests are
kept for recompute and fail only past ``outage_deadline_s``), or the loop itself hits an error
(its requests fail with INTERNAL and it starts afresh); and the engine's health: the workers
connected, and neither the step failures (``headrace.controlplane.engine.step_failures``) nor the step watchdog
(``headrace.controlplane.engine.step_watchdog``) in trouble. A mixin of ``headrace.controlplane.engine.loop.Engine``: it reads
and changes the engine's state (its in-flight steps, scheduler, requests and health)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from headrace.controlplane.engine.worker_client import WorkerError

log = logging.getLogger("headrace.engine")


class EngineOutages:
    @property
    def trouble(self) -> str | None:
        """Why the engine cannot serve although the workers are connected (None: it can)."""
        return self.faults.reason or self.watchdog.reason

    @property
    def healthy(self) -> bool:
        """The workers are connected and run steps."""
        return self.connected and self.trouble is None

    def _set_healthy(self, connected: bool) -> None:
        self.connected = connected
        self._health_changed()

    def _health_changed(self) -> None:
        """Calls ``on_health_change`` when ``healthy`` (or the watchdog's state) changed."""
        state = (self.healthy, self.watchdog.hung)
        if state != self._reported_healthy:
            self._reported_healthy = state
            if self.on_health_change is not None:
                self.on_health_change()

    def _wake_after(self, delay: float) -> None:
        """Wakes the loop in ``delay`` seconds (one timer at a time: the earliest asked for)."""
        loop = asyncio.get_running_loop()
        due, timer = loop.time() + delay, getattr(self, "_wake_timer", None)
        if timer is not None and not timer.cancelled() and timer.when() <= due and timer.when() > loop.time():
            return
        if timer is not None:
            timer.cancel()
        self._wake_timer = loop.call_at(due, self._wake.set)

    def _workers_lost(self, exc: WorkerError) -> None:
        self._inflight.fail(exc)
        log.error("worker group failed: %s; keeping %d requests for recompute", exc, len(self.requests))
        self._set_healthy(False)
        self._outage_since = time.monotonic()
        self.scheduler.reset()   # they resume by recompute when it is back

    async def _loop_failed(self, exc: Exception) -> None:
        """An unexpected error in the loop (a bug) must not leave every request waiting with
        health SERVING: the requests in flight fail with INTERNAL (they may have hit the bug),
        the step streams close (the workers forget their sequences) and the loop reconnects
        from an empty state, as after a data plane outage."""
        log.error("engine loop failed; failing %d requests: %r", len(self.requests), exc, exc_info=exc)
        self.fail_all(grpc.StatusCode.INTERNAL, f"internal error in the engine ({type(exc).__name__}); "
                      "the request was not completed")
        self._inflight.fail(WorkerError(f"engine loop failed: {exc!r}"))
        self._set_healthy(False)
        self.scheduler.reset()
        await self.workers.close_streams()

    async def _reconnect(self) -> None:
        """Waits for the workers to come back; requests kept through the outage fail with
        UNAVAILABLE once it lasts longer than ``outage_deadline_s``, and so does a request
        that arrives later in the same outage (at the next attempt)."""
        try:
            await self.workers.describe(timeout=self.config.reconnect_interval_s * 5)
            await self.workers.open()
            self._set_healthy(True)
            self._outage_since = None
            log.info("worker group reconnected; resuming %d requests", len(self.requests))
        except WorkerError:
            since = self._outage_since
            if since is not None and time.monotonic() - since > self.config.outage_deadline_s:
                self.fail_all(grpc.StatusCode.UNAVAILABLE,
                              f"data plane unavailable for more than {self.config.outage_deadline_s:g}s")
            await asyncio.sleep(self.config.reconnect_interval_s)

