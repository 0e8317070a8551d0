"""On-demand profiling of a data plane rank: a torch.profiler recording of a window of model
steps, started and stopped by the step stream itself (``StepRequest.profile``, sent by the
control plane on Admin ``StartProfile`` / ``StopProfile``), so every rank records the same
steps. The trace is a Chrome trace JSON (Perfetto, chrome://tracing, TensorBoard's profiler
plugin): host-side ATen ops and, on a GPU, the CUDA kernels with their device times (kernels
replayed from CUDA graphs included). Each step is one ``headrace.step N`` range in it.

A recording ends after its ``num_steps`` model steps (empty flush steps do not count), on a
stop command, or when the step stream ends; its ``ProfileReport`` (files written, or why
none) rides on the next result the worker returns. Writing the trace takes the step loop a
moment (post-processing the events), once per recording; while no recording runs, a step
costs one attribute test. Files:
``DIR/dataplane-rank{r}.{name}.pt.trace.json`` (TensorBoard's naming: worker, span)."""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from headrace.worker.v1 import worker_pb2 as pb

log = logging.getLogger("headrace.dataplane")


class StepProfiler:
    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._prof: torch.profiler.profile | None = None
        self._command: pb.ProfileCommand | None = None
        self._first_step = 0          # step id of the recording's first step
        self._steps = 0               # model steps finished since
        self._launched = 0            # model steps launched since (each a named range)
        self._reports: list[pb.ProfileReport] = []   # to ride on the next result

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def on_submit(self, step: pb.StepRequest) -> None:
        """Before a step is launched: obeys its profile command, if any."""
        if not step.HasField("profile"):
            return
        command = step.profile
        if command.stop:
            self.stop()
        elif command.dir and command.num_steps:
            self.stop()   # a new recording supersedes one still running
            self._start(command, step.step_id)

    def _start(self, command: pb.ProfileCommand, step_id: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            os.makedirs(command.dir, exist_ok=True)
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - a directory it cannot make, a busy profiler
            self._report([], 0, f"cannot start profiling into {command.dir}: {exc}")
            return
        self._prof, self._command = prof, command
        self._first_step, self._steps, self._launched = step_id, 0, 0
        log.info("profiling %d steps into %s", command.num_steps, command.dir)

    def step_range(self, step: pb.StepRequest):
        """The context a step is launched in: a named range in the trace for each of the
        recording's steps (the launch of the step after its last, which the pipeline starts
        before the last one finishes, may follow them, outside any range)."""
        if self._prof is None or not (step.new_seqs or step.running_seq_ids):
            return contextlib.nullcontext()
        if self._launched >= self._command.num_steps:
            return contextlib.nullcontext()
        self._launched += 1
        return torch.profiler.record_function(f"headrace.step {step.step_id}")

    def on_result(self, step: pb.StepRequest, result: pb.StepResult) -> None:
        """After a step's result is built: counts it, ends the recording after its last step,
        and hands pending reports to this result."""
        if self._prof is not None and step.step_id >= self._first_step and \
                (step.new_seqs or step.running_seq_ids):
            self._steps += 1
            if self._steps >= self._command.num_steps:
                self.stop()
        if self._reports:
            result.profile_reports.extend(self._reports)
            self._reports = []

    def stop(self) -> None:
        """Ends the recording in progress (if any) and writes its trace."""
        prof, command, self._prof = self._prof, self._command, None
        if prof is None:
            return
        path = os.path.join(command.dir, f"dataplane-rank{self.rank}.{command.name or 'profile'}.pt.trace.json")
        try:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(path)
        except Exception as exc:  # noqa: BLE001 - a full disk, a directory gone
            self._report([], self._steps, f"cannot write {path}: {exc}")
            return
        log.info("profile of %d steps written to %s", self._steps, path)
        self._report([path], self._steps, "")

    def close(self) -> None:
        """The step stream ended: a recording in progress is written (no result carries its
        report any more)."""
        self.stop()
        self._reports = []

    def _report(self, files: list[str], steps: int, error: str) -> None:
        if error:
            log.error("rank %d: %s", self.rank, error)
        self._reports.append(pb.ProfileReport(rank=self.rank, files=files, steps=steps, error=error))
