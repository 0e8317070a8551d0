"""Keeps ``headrace serve``'s data plane children alive: a child that dies is started again
(its whole tensor-parallel group, whose process group must form anew), so the control plane
reconnects and resumes its requests by recompute. Stops them on shutdown."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from typing import Callable

log = logging.getLogger("headrace.supervisor")


class DataPlaneChildren:
    def __init__(self, argvs: Callable[[], list[list[str]]], env: dict, poll_s: float = 0.2):
        self._argvs, self._env, self._poll_s = argvs, env, poll_s
        self._stop = threading.Event()
        self.children: list[subprocess.Popen] = []
        self.restarts = 0
        self._start()
        self._thread = threading.Thread(target=self._watch, name="headrace-supervisor", daemon=True)
        self._thread.start()

    def _start(self) -> None:
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

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            dead = [c for c in self.children if c.poll() is not None]
            if dead and not self._stop.is_set():
                log.error("data plane child %s exited with %s; restarting its group",
                          dead[0].pid, dead[0].returncode)
                self._terminate(timeout=5.0)
                if not self._stop.is_set():
                    self.restarts += 1
                    self._start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._terminate()
