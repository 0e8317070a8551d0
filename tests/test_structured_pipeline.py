"""The engine's side of the constrained pipeline against a fake worker group (fake grammars,
no grammar engine): after a fold, a late bitmask is followed at once by the next step (the
worker may answer the step that waited for it only once the next one arrives; the folded
step's news wait), at most one step goes out before a step's late bitmasks. Also
the bitmask rows: written into the message's own field, in memory reused between steps, and
read by the worker without a copy."""

from __future__ import annotations

import asyncio
import types

import numpy as np

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.request import Status
from headrace.controlplane.structured.outputs import StructuredOutputs
from headrace.dataplane import bitmasks
from headrace.worker.v1 import worker_pb2 as wpb
from tests.test_engine_loop import FakeWorkers, _until, make_request


class AnyToken:
    """A grammar that allows every token and never ends."""
    finished = False

    def accept(self, token: int) -> bool:
        return True


class Backend:
    def __init__(self, word: int = -1):
        self.word, self.calls = word, 0

    def fill_rows(self, matchers, rows, indexes) -> None:
        self.calls += 1
        rows[indexes] = self.word


class MaskWorkers(FakeWorkers):
    """Logs each message (a late bitmask has no result) and how many steps were in flight."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log, self.out, self.deepest = [], 0, 0

    async def send(self, msg: wpb.StepRequest) -> None:
        if msg.late_bitmask:
            self.log.append(("late", msg.step_id))
            return
        self.log.append(("step", msg.step_id, msg.bitmask_follows))
        self.out += 1
        self.deepest = max(self.deepest, self.out)
        await super().send(msg)

    async def receive(self) -> wpb.StepResult:
        result = await super().receive()
        self.out -= 1
        return result


async def _engine(workers: MaskWorkers) -> Engine:
    engine = Engine(workers, EngineConfig(pipeline_depth=3))
    await engine.start()
    engine.structured.words = 1   # the fake vocabulary: 16 tokens
    engine.structured.compiler._backend = Backend()
    engine.flush_woken = lambda: workers.log.append(("news",))
    return engine


def _constrained(engine: Engine, max_tokens: int):
    req = make_request(4, max_tokens=max_tokens)
    req.sequences[0].grammar = AnyToken()
    engine.structured.live += 1
    return req


def test_a_late_bitmask_is_followed_by_the_next_step_before_the_news():
    async def main():
        workers = MaskWorkers(num_blocks=32, block_size=4, step_s=0.002)
        engine = await _engine(workers)
        req = _constrained(engine, max_tokens=8)
        engine.submit(req)
        await _until(lambda: req.finished)
        lates = [i for i, m in enumerate(workers.log) if m[0] == "late"]
        assert len(lates) >= 4
        for i in lates[:-2]:   # (after the last ones nothing is left to schedule)
            assert workers.log[i + 1][0] == "step", workers.log
        assert workers.deepest == 3   # constrained: three steps deep ...
        for i, m in enumerate(workers.log):   # ... one step at most sent before a step's bitmasks
            if m[0] == "step" and m[2]:
                until = workers.log.index(("late", m[1]))
                assert sum(n[0] == "step" for n in workers.log[i + 1:until]) <= 1, workers.log
        assert req.sequences[0].output_token_ids == [7] * 8
        await engine.stop()
    asyncio.run(main())


def test_late_bitmasks_are_taken_by_the_writer_before_the_next_step_is_scheduled():
    """gRPC's writer is a task of the engine's loop: a late bitmask queued for it goes out
    only when the loop turns. The engine turns it before scheduling the next step (the
    worker samples on the bitmasks' arrival; the next step only feeds a forward pass)."""
    async def main():
        workers = MaskWorkers(num_blocks=32, block_size=4, step_s=0.002)
        send = workers.send

        async def send_then_write(msg):   # the writer takes the message at the next loop turn
            await send(msg)
            if msg.late_bitmask:
                asyncio.get_running_loop().call_soon(workers.log.append, ("written", msg.step_id))
        workers.send = send_then_write
        engine = await _engine(workers)
        schedule = engine.scheduler.schedule

        def logged_schedule(*args, **kwargs):
            workers.log.append(("schedule",))
            return schedule(*args, **kwargs)
        engine.scheduler.schedule = logged_schedule
        req = _constrained(engine, max_tokens=8)
        engine.submit(req)
        await _until(lambda: req.finished)
        lates = [i for i, m in enumerate(workers.log) if m[0] == "late"]
        assert len(lates) >= 4
        for i in lates[:-1]:
            after = [m[0] for m in workers.log[i + 1:]]
            assert after.index("written") < after.index("schedule"), workers.log
        await engine.stop()
    asyncio.run(main())


def test_without_a_constrained_sequence_running_the_pipeline_keeps_its_depth():
    """A constrained request still compiling (``live`` counts it) does not cut the depth of
    the unconstrained ones running."""
    async def main():
        workers = MaskWorkers(num_blocks=32, block_size=4, step_s=0.005)
        engine = await _engine(workers)
        engine.structured.live += 1   # a matcher exists, but its sequence does not run
        req = make_request(4, max_tokens=10)
        engine.submit(req)
        await _until(lambda: req.finished)
        assert workers.deepest == 3
        assert engine.structured.compiler._backend.calls == 0   # no constrained row: no masks
        await engine.stop()
    asyncio.run(main())


def _seq(seq_id: int, grammar=None, status=Status.RUNNING):
    return types.SimpleNamespace(seq_id=seq_id, grammar=grammar or AnyToken(), status=status)


def test_bitmask_rows_are_reused_and_written_into_the_message():
    outputs = StructuredOutputs("auto")
    outputs.words = 3
    outputs.compiler._backend = Backend(word=5)
    first = wpb.StepRequest(step_id=1)
    outputs.bitmask([_seq(1), _seq(2, status=Status.FINISHED)], None, first.bitmask)
    buffer = outputs._rows
    assert list(first.bitmask.seq_ids) == [1, 2]
    assert bitmasks.rows_of(first.bitmask, 96).tolist() == [[5, 5, 5], [-1, -1, -1]]   # finished: all ones
    second = outputs.bitmask([_seq(3)])
    assert outputs._rows is buffer   # no fresh memory for the next step
    assert np.frombuffer(second.bits, "<i4").tolist() == [5, 5, 5]
    assert bitmasks.rows_of(first.bitmask, 96).tolist() == [[5, 5, 5], [-1, -1, -1]]   # a copy went out
    outputs.compiler.shutdown()


def test_the_worker_reads_every_row_without_copying_them():
    words = 2
    msg = wpb.TokenBitmask(seq_ids=[4, 8], bits=np.arange(4, dtype="<i4").tobytes())
    out = bitmasks.arrays(msg, np.array([8, 4]), None, 64)
    assert out["s_mask_rows"].tolist() == [1, 0] and out["s_mask_bits"].shape == (2, words)
    assert not out["s_mask_bits"].flags.owndata   # a view of the message's bytes
    assert out["s_mask_bits"].tolist() == [[0, 1], [2, 3]]
    part = bitmasks.arrays(msg, np.array([8]), None, 64)   # 4 does not sample: its row is left out
    assert part["s_mask_bits"].tolist() == [[2, 3]]
