"""On-demand profiling, the control plane's side (Admin ``StartProfile`` / ``StopProfile``).

``StartProfile(dir, num_steps)`` arms a recording: the next step the engine sends carries a
``ProfileCommand`` to every data-plane rank (so all ranks record the same window) and, as it
leaves, the engine core starts a cProfile of its own event-loop thread (scheduling, the step
codec, folding results, streaming to the front ends, gRPC). The ranks stop by themselves after
``num_steps`` model steps and report the traces they wrote on a step result; the core's
profile then stops too and is written beside them. ``StopProfile(wait_s)`` waits up to
``wait_s`` for that, else sends a stop command (an empty flushing step if the engine is idle)
and collects what was recorded. Files, in ``dir``:

- ``dataplane-rank{r}.{name}.pt.trace.json``: rank r's torch.profiler trace (on the data
  plane's machine; ``headrace.dataplane.profiling``)
- ``core.{name}.pstats``: the engine core's cProfile (``python -m pstats``, snakeviz)
- ``core.{name}.txt``: its summary, the top functions by cumulative and by own time

``name`` is the recording's UTC start time, e.g. ``20261201T093000.123Z``; a data-parallel
core's recording adds its core, ``20261201T093000.123Z-core1`` (``Profiler.label``), so the
cores' files (and their data planes', rank 0 of each) never overwrite each other in one
directory. A front end's Admin starts and stops every core's at once
(``headrace.controlplane.frontend.admin_proxy``)."""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import logging
import os
import pstats
import time

import grpc

from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import admin_pb2 as apb

log = logging.getLogger("headrace.profiling")
REPORT_TIMEOUT_S = 120.0   # for the ranks to write their traces after a stop
SUMMARY_LINES = 40


class ProfileRefused(Exception):
    """A StartProfile / StopProfile the server cannot do now: its gRPC status and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Recording:
    def __init__(self, directory: str, num_steps: int, world_size: int, label: str = ""):
        self.dir, self.num_steps, self.world_size = directory, num_steps, world_size
        self.name = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z"
        self.name += f"-{label}" if label else ""
        self.started = False           # the start command has left with a step
        self.steps_sent = 0            # model steps sent since
        self.reports: dict[int, wpb.ProfileReport] = {}
        self.errors: list[str] = []
        self.core: cProfile.Profile | None = None
        self.core_files: list[str] = []
        self.done = asyncio.Event()    # every rank reported (or the data plane was lost)
        self.written: asyncio.Task | None = None   # the core's files, once done

    def status(self, recording: bool) -> apb.ProfileStatus:
        ranks = [self.reports[r] for r in sorted(self.reports)]
        steps = ranks[0].steps if ranks else min(self.steps_sent, self.num_steps)
        files = [f for report in ranks for f in report.files] + self.core_files
        errors = self.errors + [f"rank {r.rank}: {r.error}" for r in ranks if r.error]
        return apb.ProfileStatus(recording=recording, dir=self.dir, num_steps=self.num_steps,
                                 steps_recorded=steps, files=files, errors=errors)


class Profiler:
    """The engine's profiling state; ``wake`` wakes the engine loop (a stop to send);
    ``label``: this core's part of the files' names (``core{i}`` under data parallelism)."""

    def __init__(self, world_size: int, wake=lambda: None, label: str = ""):
        self.world_size, self.wake, self.label = world_size, wake, label
        self.recording: Recording | None = None
        self._command: wpb.ProfileCommand | None = None   # for the next step sent

    def start(self, directory: str, num_steps: int) -> apb.ProfileStatus:
        if not directory or not os.path.isabs(directory):
            raise ProfileRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"dir must be an absolute path on the server's machine, got {directory!r}")
        if num_steps < 1:
            raise ProfileRefused(grpc.StatusCode.INVALID_ARGUMENT, f"num_steps must be >= 1, got {num_steps}")
        if self.recording is not None and not self.recording.done.is_set():
            raise ProfileRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"a profile is being recorded into {self.recording.dir} already "
                                 "(StopProfile ends it)")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ProfileRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"cannot make {directory}: {exc.strerror or exc}") from None
        rec = self.recording = Recording(directory, num_steps, self.world_size, self.label)
        self._command = wpb.ProfileCommand(dir=directory, num_steps=num_steps, name=rec.name)
        log.info("profiling the next %d steps into %s", num_steps, directory)
        return rec.status(True)

    @property
    def pending_stop(self) -> bool:
        """A stop command waits for a step to carry it to the workers."""
        return self._command is not None and self._command.stop

    def attach(self, msg: wpb.StepRequest) -> None:
        """Called for every step message sent: gives it the pending command; counts steps."""
        rec = self.recording
        if self._command is not None:
            msg.profile.CopyFrom(self._command)
            if not self._command.stop:
                rec.started = True
                rec.core = self._start_core(rec)
            self._command = None
        if rec is not None and rec.started and not rec.done.is_set() and (msg.new_seqs or msg.running_seq_ids):
            rec.steps_sent += 1

    @staticmethod
    def _start_core(rec: Recording) -> cProfile.Profile | None:
        core = cProfile.Profile()
        try:
            core.enable()
        except ValueError as exc:   # another profiler (a debugger, coverage) holds the hook
            rec.errors.append(f"engine core: cannot profile ({exc})")
            return None
        return core

    def received(self, result: wpb.StepResult) -> None:
        """A step result with rank reports: the recording ends once every rank has reported."""
        rec = self.recording
        if rec is None or rec.done.is_set():
            return
        for report in result.profile_reports:
            rec.reports[report.rank] = report
        if len(rec.reports) >= rec.world_size:
            self._finish(rec)

    def lost(self, why: str) -> None:
        """The workers failed: their recordings are gone; the core's is written."""
        rec = self.recording
        if rec is not None and rec.started and not rec.done.is_set():
            rec.errors.append(f"the data plane was lost while profiling: {why}")
            self._finish(rec)

    def _finish(self, rec: Recording) -> None:
        if rec.core is not None:
            rec.core.disable()
        rec.done.set()
        rec.written = asyncio.get_running_loop().create_task(asyncio.to_thread(self._write_core, rec))

    async def stop(self, wait_s: float) -> apb.ProfileStatus:
        rec = self.recording
        if rec is None:
            raise ProfileRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 "no profile was started (StartProfile first)")
        if wait_s > 0 and not rec.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rec.done.wait(), wait_s)
        if not rec.done.is_set():
            if not rec.started:   # no step went out: nothing was recorded anywhere
                self._command = None
                rec.errors.append("no engine step ran while profiling (send requests during the window)")
                rec.done.set()
            else:
                self._command = wpb.ProfileCommand(stop=True)
                self.wake()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(rec.done.wait(), REPORT_TIMEOUT_S)
                if not rec.done.is_set():
                    missing = sorted(set(range(rec.world_size)) - set(rec.reports))
                    rec.errors.append(f"no report from data plane rank(s) {missing} "
                                      f"within {REPORT_TIMEOUT_S:.0f}s")
                    self._finish(rec)
        if rec.written is not None:
            await rec.written
        self.recording = None
        return rec.status(False)

    @staticmethod
    def _write_core(rec: Recording) -> None:
        if rec.core is None:
            return
        stats_path = os.path.join(rec.dir, f"core.{rec.name}.pstats")
        text_path = os.path.join(rec.dir, f"core.{rec.name}.txt")
        try:
            rec.core.dump_stats(stats_path)
            out = io.StringIO()
            stats = pstats.Stats(rec.core, stream=out)
            out.write(f"engine core (pid {os.getpid()}), {rec.steps_sent} steps sent while recording; "
                      f"full profile: python -m pstats {stats_path}\n")
            stats.sort_stats("cumulative").print_stats(SUMMARY_LINES)
            stats.sort_stats("tottime").print_stats(SUMMARY_LINES)
            with open(text_path, "w") as f:
                f.write(out.getvalue())
        except OSError as exc:
            rec.errors.append(f"engine core: cannot write {stats_path}: {exc.strerror or exc}")
            return
        rec.core_files = [stats_path, text_path]
        log.info("engine core profile written to %s", stats_path)
