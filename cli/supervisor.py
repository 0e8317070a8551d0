"""Keeps ``headrace serve``'s data plane children alive: a child that dies is started again
(its whole tensor-parallel group, whose process group must form anew), so the control plane
reconnects and resumes its requests by recompute. Stops them on shutdown.

A group that dies before it ever served (its health never SERVING) failed to load: at start-up
that is fatal (``serve`` ends with the child's one-line reason and a non-zero status, no
restart loop); after the model has served, restarts wait an exponentially growing delay
(``backoff``: first, longest; reset once a group has served for ``stable_s``), and after
``max_load_failures`` failed loads in a row the supervisor gives up (the control plane stays
NOT_SERVING; a log line; the ``headrace:dataplane_given_up`` gauge).

A group whose engine core reports a step hung (``hung``: the core's step watchdog,
``headrace.controlplane.engine.step_watchdog``, says the data plane has not answered for
``--step-hang-timeout``) is killed (SIGKILL: a stopped process takes nothing else) and restarted
like one that died; the core resumes its requests by recompute."""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import threading
import time
from typing import Callable

log = logging.getLogger("headrace.supervisor")

EXIT_LOAD_FAILED = 3   # a data plane that printed why it could not load its model


def core_watchdog_probe(address: str, ca: str | None = None) -> Callable[[], bool]:
    """Whether the engine core at ``address`` reports its data plane hung (its step watchdog's
    health service NOT_SERVING; health checks need no secret)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from headrace.controlplane.engine.step_watchdog import HEALTH_SERVICE

    channel = []
    # a core that is not listening yet (or restarting) must not push the channel's reconnect
    # back-off towards its two minutes: the next probe after it is back must reach it
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000)]

    def hung() -> bool:
        if not channel:
            if ca and not address.startswith("unix:"):
                with open(ca, "rb") as f:
                    channel.append(grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()),
                                                       options=options))
            else:
                channel.append(grpc.insecure_channel(address, options=options))
        try:
            status = health_pb2_grpc.HealthStub(channel[0]).Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=1).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.NOT_SERVING

    return hung


def health_probe(listens: list[str]) -> Callable[[], bool]:
    """Whether every data plane at ``listens`` answers SERVING (health checks need no secret)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = {}
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000)]   # (a restarted child is seen at once)

    def ready() -> bool:
        for address in listens:
            channel = channels.get(address) or channels.setdefault(
                address, grpc.insecure_channel(address, options=options))
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                  timeout=1).status
            except grpc.RpcError:
                return False
            if status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True

    return ready


class DataPlaneChildren:
    def __init__(self, argvs: Callable[[], list[list[str]]], env: dict, poll_s: float = 0.2, *,
                 ready: Callable[[], bool] | None = None, metrics=None,
                 backoff: tuple[float, float] = (1.0, 30.0), max_load_failures: int = 3,
                 stable_s: float = 60.0, hung: Callable[[], bool] | None = None,
                 hung_poll_s: float = 1.0):
        self._argvs, self._env, self._poll_s = argvs, env, poll_s
        self._hung, self._hung_poll_s, self._hung_checked = hung, hung_poll_s, 0.0
        self.killed_hung = 0
        self._ready = ready or (lambda: True)
        self.metrics = metrics            # headrace.controlplane.metrics.ControlPlaneMetrics or None
        self.backoff, self.max_load_failures, self.stable_s = backoff, max_load_failures, stable_s
        self._stop = threading.Event()
        self.children: list[subprocess.Popen] = []
        self.restarts = 0
        self.delays: collections.deque[float] = collections.deque(maxlen=32)   # before each restart
        self.served = False               # some group has served
        self.load_failures = 0            # failed loads in a row since the last group served
        self.given_up: str | None = None  # why the supervisor stopped restarting
        self.fatal = False                # given up at start-up: serve must end
        self.exit_status: int | None = None   # of the child that ended the group last
        self._serving_since: float | None = None
        self._delays = 0
        self._on_give_up: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        from headrace.cli.processes import at_force_exit, kill_group

        at_force_exit(lambda: kill_group(self.children))
        self._start()
        self._thread = threading.Thread(target=self._watch, name="headrace-supervisor", daemon=True)
        self._thread.start()

    def when_fatal(self, fn: Callable[[], None]) -> None:
        """Calls ``fn`` (from any thread) once the group failed to start, at once if it has."""
        with self._lock:
            if not self.fatal:
                self._on_give_up.append(fn)
                return
        fn()

    def _start(self) -> None:
        self._serving_since = None
        self.children = [subprocess.Popen(argv, start_new_session=True, env=self._env)
                         for argv in self._argvs()]

    def _terminate(self, timeout: float = 10.0) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def _give_up(self, why: str, fatal: bool) -> None:
        self.given_up = why
        if self.metrics is not None:
            self.metrics.dataplane_given_up.set(1)
        if not fatal:
            log.error("%s; not restarting it again: the server stays NOT_SERVING", why)
            return
        with self._lock:
            self.fatal = True
            callbacks, self._on_give_up = self._on_give_up, []
        for fn in callbacks:
            fn()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            dead = [c for c in self.children if c.poll() is not None]
            if not dead:
                self._note_serving()
                self._kill_if_hung()
                continue
            if self._stop.is_set():
                return
            code = self.exit_status = dead[0].returncode
            loading = self._serving_since is None   # it died before its group served
            self._terminate(timeout=5.0)
            if loading and not self.served:
                self._give_up(f"the data plane exited with status {code} while loading the model",
                              fatal=True)
                return
            cause = "hung" if self._killed else "crash"
            self._killed = False
            if loading:
                self.load_failures += 1
                cause = "load_failure"
                if self.load_failures >= self.max_load_failures:
                    self._give_up(f"the data plane failed to load the model {self.load_failures} "
                                  f"times in a row", fatal=False)
                    return
            first, longest = self.backoff
            delay = min(longest, first * 2 ** self._delays)
            self._delays += 1
            self.delays.append(delay)
            log.error("data plane child %s exited with %s (%s); restarting its group in %.1fs",
                      dead[0].pid, code, cause.replace("_", " "), delay)
            if self.metrics is not None:
                self.metrics.dataplane_restarts.labels(cause).inc()
            if self._stop.wait(delay):
                return
            self.restarts += 1
            self._start()

    _killed = False

    def _kill_if_hung(self) -> None:
        """Kills the group when its engine core reports a step hung (after it has served)."""
        now = time.monotonic()
        if self._hung is None or self._serving_since is None or now - self._hung_checked < self._hung_poll_s:
            return
        self._hung_checked = now
        if not self._hung():
            return
        log.error("the engine core reports a data plane step hung; killing the data plane "
                  "(pids %s) to restart it", ", ".join(str(c.pid) for c in self.children))
        self._killed = True
        self.killed_hung += 1
        for child in self.children:
            if child.poll() is None:
                child.kill()

    def _note_serving(self) -> None:
        now = time.monotonic()
        if self._serving_since is None:
            if self._ready():
                self._serving_since, self.served, self.load_failures = now, True, 0
        elif self._delays and now - self._serving_since >= self.stable_s:
            self._delays = 0   # it has served long enough: the next crash restarts at once

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._terminate()
