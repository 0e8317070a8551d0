"""A step the data plane reports it raised (``StepResult.error``, controlplane/engine/step_failures.py),
against stand-in workers that raise on demand as a data plane does (the step that raised and
every later one on the stream are answered with the error until a fresh stream opens): a
poisoned request fails alone with INTERNAL naming the error class while the others finish; a
request alone on the server is blamed only after a canary step passes; a transient error fails
no one; a broken worker turns health NOT_SERVING, fails held requests past the deadline, and
serves again once its steps pass."""

from __future__ import annotations

import asyncio
import itertools

import grpc

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.worker.v1 import worker_pb2 as wpb
from tests.test_engine_loop import TOKEN, FakeWorkers, _until, make_request

POISON = 13   # a prompt of this token makes every step that samples it raise


class RaisingWorkers(FakeWorkers):
    """``raise_all``: every step with sequences raises; ``raise_once``: the next one does."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.poisoned: set[int] = set()
        self.failed: wpb.StepError | None = None
        self.raise_all = self.raise_once = False
        self.errors = 0

    async def open(self) -> None:   # a fresh stream: nothing of the old one comes back
        await super().open()
        self.failed = None
        self.results = asyncio.Queue()

    async def send(self, msg: wpb.StepRequest) -> None:
        if self.failed is None:
            for new in msg.new_seqs:
                if new.prompt_token_ids and new.prompt_token_ids[0] == POISON:
                    self.poisoned.add(new.seq_id)
            ids = {n.seq_id for n in msg.new_seqs} | set(msg.running_seq_ids)
            if ids and (self.raise_all or self.raise_once or ids & self.poisoned):
                self.raise_once = False
                self.errors += 1
                self.failed = wpb.StepError(step_id=msg.step_id, error_class="IndexError",
                                            message="index 99 is out of bounds")
        if self.failed is not None:
            self.steps += 1
            self.results.put_nowait(wpb.StepResult(step_id=msg.step_id, error=self.failed))
            return
        await super().send(msg)


def _engine(workers, **config):
    engine = Engine(workers, EngineConfig(max_batched_tokens=64, **config))
    engine.seq_ids = itertools.count(10 ** 6)   # (the canary's ids apart from make_request's)
    return engine


def test_a_poisoned_request_fails_alone_and_the_others_finish():
    async def main():   # (answers take a while: several steps are in flight when one raises)
        workers = RaisingWorkers(num_blocks=64, block_size=4, step_s=0.002)
        engine = _engine(workers)
        await engine.start()
        others = [make_request(5, max_tokens=12) for _ in range(7)]
        for req in others:
            engine.submit(req)
        await _until(lambda: all(len(r.sequences[0].output_token_ids) >= 2 for r in others))
        poisoned = make_request(4, max_tokens=12, token=POISON)
        engine.submit(poisoned)
        health = []
        while not all(r.finished for r in others) or poisoned.failure is None:
            health.append(engine.healthy)
            await asyncio.sleep(0.001)
        assert poisoned.failure.code == grpc.StatusCode.INTERNAL
        assert "IndexError" in poisoned.failure.message
        for req in others:
            assert req.failure is None and req.sequences[0].output_token_ids == [TOKEN] * 12
        assert all(health), "a poisoned request made the server unhealthy"
        assert engine.faults.culprits == 1 and not engine.faults.active
        await _until(lambda: engine.scheduler.blocks.num_free == 64)
        after = make_request(5, max_tokens=3)   # served normally afterwards
        engine.submit(after)
        await _until(lambda: after.finished)
        assert after.failure is None
        assert workers.errors <= 4   # the step, its retry, the request apart (after a pass)
        await engine.stop()
    asyncio.run(main())


def test_a_poisoned_request_alone_is_blamed_after_a_canary_step_passes():
    async def main():
        workers = RaisingWorkers(num_blocks=32, block_size=4)
        engine = _engine(workers)
        await engine.start()
        poisoned = make_request(4, max_tokens=5, token=POISON)
        engine.submit(poisoned)
        await _until(lambda: poisoned.failure is not None)
        assert poisoned.failure.code == grpc.StatusCode.INTERNAL and "IndexError" in poisoned.failure.message
        assert engine.healthy and not engine.faults.active and engine.faults.canary is None
        await _until(lambda: engine.scheduler.blocks.num_free == 32)
        assert not engine.requests
        await engine.stop()
    asyncio.run(main())


def test_a_transient_step_error_fails_no_one():
    async def main():
        workers = RaisingWorkers(num_blocks=64, block_size=4, step_s=0.002)
        engine = _engine(workers)
        await engine.start()
        reqs = [make_request(5, max_tokens=10) for _ in range(4)]
        for req in reqs:
            engine.submit(req)
        await _until(lambda: all(len(r.sequences[0].output_token_ids) >= 3 for r in reqs))
        workers.raise_once = True
        await _until(lambda: all(r.finished for r in reqs))
        assert workers.errors == 1
        for req in reqs:
            assert req.failure is None and req.sequences[0].output_token_ids == [TOKEN] * 10
        assert engine.faults.culprits == 0 and engine.healthy
        await engine.stop()
    asyncio.run(main())


def test_a_broken_worker_is_not_serving_fails_held_requests_past_the_deadline_and_recovers(monkeypatch):
    from headrace.controlplane.engine import step_failures

    monkeypatch.setattr(step_failures, "BACKOFF_S", (0.05, 0.2))

    async def main():
        workers = RaisingWorkers(num_blocks=64, block_size=4)
        engine = _engine(workers, outage_deadline_s=0.6)
        changes = []
        engine.on_health_change = lambda: changes.append(engine.healthy)
        await engine.start()
        workers.raise_all = True
        reqs = [make_request(5, max_tokens=6) for _ in range(3)]
        for req in reqs:
            engine.submit(req)
        await _until(lambda: not engine.healthy)
        assert "broken" in engine.trouble and "IndexError" in engine.trouble
        assert all(r.failure is None for r in reqs), "a broken worker blamed a request"
        steps = workers.steps
        await asyncio.sleep(0.3)
        assert workers.steps - steps < 10, "the engine spun on a broken worker"
        await _until(lambda: all(r.failure is not None for r in reqs), timeout=3.0)
        assert all(r.failure.code == grpc.StatusCode.UNAVAILABLE for r in reqs)
        assert "keep failing" in reqs[0].failure.message
        await _until(lambda: engine.scheduler.blocks.num_free == 64)
        workers.raise_all = False   # fixed: the next canary passes
        await _until(lambda: engine.healthy, timeout=3.0)
        again = make_request(5, max_tokens=3)
        engine.submit(again)
        await _until(lambda: again.finished)
        assert again.failure is None and again.sequences[0].output_token_ids == [TOKEN] * 3
        assert changes[:2] == [True, False] and changes[-1] is True
        await engine.stop()
    asyncio.run(main())


def test_requests_held_while_the_broken_worker_recovers_finish():
    from headrace.controlplane.engine import step_failures

    async def main():
        step_failures.BACKOFF_S, saved = (0.05, 0.1), step_failures.BACKOFF_S
        try:
            workers = RaisingWorkers(num_blocks=64, block_size=4)
            engine = _engine(workers, outage_deadline_s=30)
            await engine.start()
            workers.raise_all = True
            reqs = [make_request(5, max_tokens=6) for _ in range(3)]
            for req in reqs:
                engine.submit(req)
            await _until(lambda: not engine.healthy)
            workers.raise_all = False
            await _until(lambda: all(r.finished for r in reqs), timeout=3.0)
            assert all(r.failure is None and r.sequences[0].output_token_ids == [TOKEN] * 6 for r in reqs)
            assert engine.healthy
            await engine.stop()
        finally:
            step_failures.BACKOFF_S = saved
    asyncio.run(main())
