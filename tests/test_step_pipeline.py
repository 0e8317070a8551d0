"""``headrace.dataplane.pipeline.StepPipeline``'s order of runner calls, against a runner that logs
them (no model): a step held back until the next is launched, a step that comes while the one
before waits for its bitmasks (prepared ahead, then launched before or after that step's
answer, by whether the device still runs), and the refusals."""

from __future__ import annotations

import pytest

from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.pipeline import StepPipeline
from headrace.worker.v1 import worker_pb2 as wpb


class Launched:
    def __init__(self, step: wpb.StepRequest, done: bool):
        self.step_id, self.verified, self.done = step.step_id, None, done
        self.awaiting = True if step.bitmask_follows else None
        self.out = None if step.bitmask_follows else True

    def forward_done(self) -> bool:
        return self.done


class LogRunner:
    """Logs (call, step id); ``forward_done`` says whether launched forward passes are over."""

    def __init__(self, forward_done: bool, history: bool = False):
        self.log, self.forward_done, self.history = [], forward_done, history

    def needs_history(self, step):
        return self.history

    def prepare_ahead(self, step):
        self.log.append(("prepare", step.step_id))

    def launch(self, step):
        self.log.append(("launch", step.step_id))
        return Launched(step, self.forward_done)

    def sample_late(self, launched, msg):
        self.log.append(("sample", msg.step_id))
        launched.awaiting, launched.out = None, True

    def finish(self, launched):
        self.log.append(("finish", launched.step_id))
        return wpb.StepResult(step_id=launched.step_id)


def step(step_id, follows=False, flush=False):
    return wpb.StepRequest(step_id=step_id, running_seq_ids=[1], running_num_scheduled=[1],
                           bitmask_follows=follows, flush=flush)


def late(step_id):
    return wpb.StepRequest(step_id=step_id, late_bitmask=True)


def ids(results):
    return [r.step_id for r in results]


def test_a_step_is_answered_once_the_next_is_launched():
    runner = LogRunner(forward_done=False)
    pipe = StepPipeline(runner)
    assert pipe.submit(step(1)) == []
    assert ids(pipe.submit(step(2))) == [1]
    assert ids(pipe.drain()) == [2]
    assert runner.log == [("launch", 1), ("launch", 2), ("finish", 1), ("finish", 2)]


def test_while_the_device_runs_a_step_prepared_ahead_is_launched_before_the_answer():
    """Step 3 came while step 2 waited for its bitmasks: its host half ran then. Step 2's
    forward pass still runs when they come: step 3 is queued behind step 2's sampling before
    step 2 is answered (the device never waits for this host)."""
    runner = LogRunner(forward_done=False)
    pipe = StepPipeline(runner)
    assert ids(pipe.submit(step(1)) + pipe.submit(step(2, follows=True))) == [1]
    assert pipe.submit(step(3, follows=True)) == []
    assert ids(pipe.submit(late(2))) == [2] and pipe.deferred is None
    assert runner.log[-4:] == [("prepare", 3), ("sample", 2), ("launch", 3), ("finish", 2)]
    assert pipe.submit(late(3)) == []   # step 3's forward pass runs: its answer waits for step 4
    assert ids(pipe.submit(step(4)) + pipe.drain()) == [3, 4]


def test_when_the_device_waits_the_answer_goes_before_the_prepared_launch():
    """Step 2's forward pass is over when its bitmasks come: the device waits for the control
    plane, so step 2 is answered first and step 3 is launched by ``resume``, after that
    answer is out."""
    runner = LogRunner(forward_done=True)
    pipe = StepPipeline(runner)
    pipe.submit(step(1))
    pipe.submit(step(2, follows=True))
    pipe.submit(step(3, follows=True))
    assert ids(pipe.submit(late(2))) == [2]
    assert pipe.deferred is not None and runner.log[-2:] == [("sample", 2), ("finish", 2)]
    assert pipe.resume() == [] and pipe.deferred is None and runner.log[-1] == ("launch", 3)
    assert ids(pipe.submit(late(3))) == [3]   # (answered at once: its forward pass is done)


def test_a_deferred_launch_runs_before_the_next_message_even_without_resume():
    runner = LogRunner(forward_done=True)
    pipe = StepPipeline(runner)
    for s in (step(1), step(2, follows=True), step(3, follows=True), late(2)):
        pipe.submit(s)
    assert ids(pipe.submit(late(3))) == [3]
    assert runner.log[-3:] == [("launch", 3), ("sample", 3), ("finish", 3)]


def test_a_step_that_needs_the_history_is_not_prepared_ahead():
    """Its penalties need step 2's token: it is held as sent, and launched after step 2 is
    finished."""
    runner = LogRunner(forward_done=False, history=True)
    pipe = StepPipeline(runner)
    pipe.submit(step(1))
    pipe.submit(step(2, follows=True))
    assert pipe.submit(step(3)) == [] and ("prepare", 3) not in runner.log
    assert ids(pipe.submit(late(2))) == [2]
    assert runner.log[-3:] == [("sample", 2), ("finish", 2), ("launch", 3)]


def test_two_steps_before_the_bitmasks_are_refused():
    pipe = StepPipeline(LogRunner(forward_done=False))
    pipe.submit(step(1))
    pipe.submit(step(2, follows=True))
    pipe.submit(step(3))
    with pytest.raises(BatchError, match="came before the bitmasks step 2 waits for"):
        pipe.submit(step(4))
