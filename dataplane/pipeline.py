"""The order in which a worker launches and finishes steps (the step protocol's pipelining):
``StepPipeline`` holds at most one launched step back while it launches the next, and at most
one step that came while a launched step waits for its bitmasks."""

from __future__ import annotations

from headrace.common import stage_times
from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.launched import Launched
from headrace.dataplane.runner import ModelRunner
from headrace.worker.v1 import worker_pb2 as pb


class StepPipeline:
    """Feeds steps to a runner the way the step protocol allows: each step is launched before the
    one before it is finished, unless it asks for ``flush`` (or samples nothing, or the next step's
    penalties need the previous token, or it verifies speculative drafts). ``submit`` returns the
    results that are ready, in step order; ``drain`` finishes what is left. A step launched with
    ``bitmask_follows`` stays unsampled until the ``late_bitmask`` message that must come next.
    ``launch`` and ``finish`` replace the runner's own calls (to time or trace each step around
    them)."""

    def __init__(self, runner: ModelRunner, finish=None, launch=None):
        self.runner = runner
        self._finish = finish or (lambda step, launched: runner.finish(launched))
        self._launch = launch or runner.launch
        self._pending: tuple[pb.StepRequest, Launched] | None = None
        self._ahead: pb.StepRequest | None = None   # came while the pending step awaits bitmasks
        self.deferred: pb.StepRequest | None = None   # to launch once the answers are out (``resume``)

    def submit(self, step: pb.StepRequest) -> list[pb.StepResult]:
        if self.deferred is not None:   # (``resume`` was not called)
            return self.resume() + self.submit(step)
        if step.late_bitmask:
            return self._late_bitmask(step)
        if self._pending is not None and self._pending[1].awaiting is not None:
            if self._ahead is not None:
                raise BatchError(f"step {step.step_id} came before the bitmasks step "
                                 f"{self._pending[0].step_id} waits for (step "
                                 f"{self._ahead.step_id} came already)")
            self._ahead = step
            if not self.runner.needs_history(step):   # (else it waits for that step's tokens)
                self.runner.prepare_ahead(step)
            return []
        ready = []
        if self._pending is not None and self.runner.needs_history(step):
            ready.append(self._done())
        launched = self._launch(step)
        if self._pending is not None:
            ready.append(self._done())
        self._pending = (step, launched)
        if launched.awaiting is None and self._answer_now(step, launched):
            ready.append(self._done())
        return ready

    @staticmethod
    def _answer_now(step: pb.StepRequest, launched: Launched) -> bool:
        return step.flush or launched.out is None or launched.verified is not None

    def _late_bitmask(self, msg: pb.StepRequest) -> list[pb.StepResult]:
        """Samples the step waiting for these bitmasks (no result of its own). It is answered
        at once when its forward pass is already done: the device waits for the bitmasks
        then, so the control plane's round trip (the token, the next bitmasks) is the step's
        critical path, and holding the answer for the next step's launch would lengthen it.
        While the forward pass still runs, the answer waits for the next step as usual (that
        step is launched before this one's tokens are waited for: no bubble on the device).
        A step that came ahead of these bitmasks is that next step: launched now while the
        forward pass runs, else ``deferred`` until this step's answer is out."""
        if self._pending is None:
            raise BatchError(f"late bitmasks for step {msg.step_id}, which waits for none")
        step, launched = self._pending
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(f"step:{msg.step_id}", "w_sample_in")
        self.runner.sample_late(launched, msg)
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(f"step:{msg.step_id}", "w_sampled")
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if not launched.forward_done():   # launched now, behind this sampling: the device
                return self.submit(ahead)     # goes on while this step's answer waits for it
            self.deferred = ahead   # the device waits for the control plane: the answer first
            return [self._done()]
        if self._answer_now(step, launched) or launched.forward_done():
            return [self._done()]
        return []

    def resume(self) -> list[pb.StepResult]:
        """Launches the step ``submit`` deferred until its answers were sent (call it then, while
        ``deferred`` is set); returns the results that became ready."""
        step, self.deferred = self.deferred, None
        return self.submit(step) if step is not None else []

    def drain(self) -> list[pb.StepResult]:
        ready = self.resume()
        return ready + [self._done()] if self._pending is not None else ready

    def _done(self) -> pb.StepResult:
        (step, launched), self._pending = self._pending, None
        return self._finish(step, launched)
