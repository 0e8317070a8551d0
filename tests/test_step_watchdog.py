"""The step watchdog (controlplane/engine/step_watchdog.py) against stand-in workers whose answers can
be held back: a step owed past the floor while the workers do not answer a health check turns
health NOT_SERVING (and back once it is answered); one owed as long while they answer is slow,
not stalled; stalled past the hang bound it is hung (the core's watchdog service NOT_SERVING);
the thresholds follow the longest step seen of each size."""

from __future__ import annotations

import asyncio

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.controlplane.engine.step_watchdog import StepWatchdog, bucket
from tests.test_engine_loop import FakeWorkers, _until, make_request


class HoldingWorkers(FakeWorkers):
    """``hold``: results are kept back (a stopped data plane); ``answers``: its health checks."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hold = asyncio.Event()
        self.hold.set()
        self.answers = True

    async def receive(self):
        await self.hold.wait()
        return await super().receive()

    async def alive(self, timeout: float) -> bool:
        if not self.answers:
            await asyncio.sleep(min(timeout, 0.05))
        return self.answers


def _engine(workers, **config):
    return Engine(workers, EngineConfig(step_timeout_floor_s=0.2, step_hang_timeout_s=0.6, **config))


def test_a_step_unanswered_by_a_silent_data_plane_turns_health_not_serving_and_back(monkeypatch):
    from headrace.controlplane.engine import step_watchdog

    monkeypatch.setattr(step_watchdog, "INTERVAL_S", 0.05)

    async def main():
        workers = HoldingWorkers(num_blocks=32, block_size=4)
        engine = _engine(workers)
        changes = []
        engine.on_health_change = lambda: changes.append((engine.healthy, engine.watchdog.hung))
        await engine.start()
        warm = make_request(4, max_tokens=3)
        engine.submit(warm)
        await _until(lambda: warm.finished)
        workers.hold.clear()
        workers.answers = False   # SIGSTOP
        req = make_request(4, max_tokens=4)
        engine.submit(req)
        took = await _until(lambda: not engine.healthy, timeout=3)
        assert 0.2 <= took < 1.5
        assert "does not answer health checks" in engine.trouble
        await _until(lambda: engine.watchdog.hung, timeout=3)   # past the hang bound
        workers.answers = True
        workers.hold.set()   # SIGCONT: the step is answered
        await _until(lambda: engine.healthy and not engine.watchdog.hung, timeout=3)
        await _until(lambda: req.finished)
        assert req.failure is None
        assert changes[-3:] == [(False, False), (False, True), (True, False)]
        await engine.stop()
    asyncio.run(main())


def test_a_slow_step_of_a_data_plane_that_answers_is_not_stalled(monkeypatch):
    from headrace.controlplane.engine import step_watchdog

    monkeypatch.setattr(step_watchdog, "INTERVAL_S", 0.05)

    async def main():
        workers = HoldingWorkers(num_blocks=32, block_size=4)
        engine = _engine(workers)
        await engine.start()
        workers.hold.clear()   # a long prefill: the data plane computes, and answers probes
        req = make_request(4, max_tokens=2)
        engine.submit(req)
        await asyncio.sleep(0.8)
        assert engine.healthy and not engine.watchdog.hung
        workers.hold.set()
        await _until(lambda: req.finished)
        await engine.stop()
    asyncio.run(main())


def test_thresholds_follow_the_longest_step_of_each_size():
    watchdog = StepWatchdog(engine=None)

    def step(tokens):
        s = ScheduledStep()
        s.new = [type("N", (), {"num_tokens": tokens})()]
        return s

    assert watchdog.expected(100) == 0.0
    watchdog.observe(step(16), 0.01)
    watchdog.observe(step(16), 0.02)
    watchdog.observe(step(9), 0.5)   # 9 tokens: the bucket below 16's
    assert bucket(16) == 5 and watchdog.expected(16) == 0.02 and watchdog.expected(17) == 0.02
    assert watchdog.expected(64) == 0.02 * 16   # two doublings beyond: quadrupled each
    assert watchdog.expected(12) == 0.5
    assert watchdog.expected(2) == 0.02          # smaller than any seen: the least of those above
