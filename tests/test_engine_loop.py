"""The engine loop against an in-process fake worker group: requests run to the end through
the pipeline, an idle engine waits on its wake event instead of polling, and a waiting
request is admitted as soon as an abort frees the blocks it needs."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.requests.request import Request, Sequence, Status
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

TOKEN = 7


class FakeWorkers:
    """Answers every step in order like a data plane's rank 0: a sequence samples once all
    the tokens it knows are computed (the token it sampled is then known to it)."""

    broken = False   # (a data plane's step stream never ends by itself here)

    def __init__(self, num_blocks: int = 16, block_size: int = 4, step_s: float = 0.0):
        self.info = wpb.WorkerInfo(model_name="fake", vocab_size=16, max_model_len=num_blocks * block_size,
                                   block_size=block_size, num_kv_blocks=num_blocks)
        self.step_s = step_s
        self.results: asyncio.Queue = asyncio.Queue()
        self.known: dict[int, int] = {}      # seq id -> tokens it knows
        self.computed: dict[int, int] = {}   # seq id -> tokens computed
        self.steps = 0

    @property
    def num_kv_blocks(self) -> int:
        return self.info.num_kv_blocks

    async def describe(self, timeout: float):
        return [self.info]

    async def open(self) -> None:
        self.known.clear()
        self.computed.clear()

    async def close_streams(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _compute(self, seq_id: int, n: int, result: wpb.StepResult) -> None:
        self.computed[seq_id] += n
        assert self.computed[seq_id] <= self.known[seq_id], "scheduled past the known tokens"
        if self.computed[seq_id] == self.known[seq_id]:
            result.seq_ids.append(seq_id)
            result.token_ids.append(TOKEN)
            self.known[seq_id] += 1

    async def send(self, msg: wpb.StepRequest) -> None:
        self.steps += 1
        for seq_id in msg.finished_seq_ids:
            del self.known[seq_id], self.computed[seq_id]
        result = wpb.StepResult(step_id=msg.step_id)
        for new in msg.new_seqs:
            self.known[new.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.seq_id] = new.num_computed_tokens
            self._compute(new.seq_id, new.num_scheduled_tokens, result)
        for seq_id, n in zip(msg.running_seq_ids, msg.running_num_scheduled):
            self._compute(seq_id, n, result)
        self.results.put_nowait(result)

    async def receive(self) -> wpb.StepResult:
        if self.step_s:
            await asyncio.sleep(self.step_s)
        return await self.results.get()


class _NoText:
    def step(self, token_id):
        return ""

    def flush(self):
        return ""


_ids = itertools.count(1)


def make_request(prompt_len: int, max_tokens: int, token: int = 3) -> Request:
    req = Request(request_id=f"r{next(_ids)}")
    req.sequences.append(Sequence(request=req, seq_id=next(_ids), index=0, prompt_token_ids=[token] * prompt_len,
                                  sampling=wpb.Sampling(top_p=1, repetition_penalty=1), max_tokens=max_tokens,
                                  output=OutputText(_NoText(), [])))
    return req


async def _until(predicate, timeout: float = 2.0) -> float:
    """Seconds until ``predicate()`` holds (fails the test after ``timeout``)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout, "timed out"
        await asyncio.sleep(0.001)
    return loop.time() - start


def _count_schedules(engine: Engine) -> list[int]:
    calls = [0]
    schedule = engine.scheduler.schedule

    def counted(*args):
        calls[0] += 1
        return schedule(*args)
    engine.scheduler.schedule = counted
    return calls


def test_requests_run_to_the_end_through_the_pipeline():
    async def main():
        workers = FakeWorkers(num_blocks=16, block_size=4)
        engine = Engine(workers, EngineConfig(max_batched_tokens=8))
        await engine.start()
        reqs = [make_request(5 + i, max_tokens=6 + i) for i in range(4)]
        for r in reqs:
            engine.submit(r)
        await _until(lambda: all(r.finished for r in reqs))
        for r in reqs:
            seq = r.sequences[0]
            assert seq.output_token_ids == [TOKEN] * seq.max_tokens
            assert seq.finish_reason == pb.FINISH_REASON_LENGTH
        await _until(lambda: engine.scheduler.blocks.num_free == 16)
        await engine.stop()
    asyncio.run(main())


def test_idle_engine_with_work_it_cannot_admit_waits_for_an_event():
    async def main():
        workers = FakeWorkers(num_blocks=8, block_size=4)
        engine = Engine(workers, EngineConfig())
        await engine.start()
        blocks = engine.scheduler.blocks
        blocks.grow(-1, 8 * 4)   # every block held (by no sequence the scheduler runs)
        calls = _count_schedules(engine)
        req = make_request(5, max_tokens=3)
        engine.submit(req)
        await asyncio.sleep(0.1)
        seq = req.sequences[0]
        assert seq.status is Status.WAITING and engine.scheduler.waiting == [seq]
        # A 1 ms poll would have scheduled ~100 times; waiting on the event, once or twice.
        assert calls[0] <= 2, f"the engine polled: {calls[0]} schedules in 0.1 s"
        steps = workers.steps
        blocks.free(-1)
        engine.reconfigure(max_batched_tokens=64)   # an event: the engine looks again at once
        assert await _until(lambda: req.finished, timeout=1.0) < 0.5
        assert workers.steps > steps
        await engine.stop()
    asyncio.run(main())


def test_waiting_request_is_admitted_when_an_abort_frees_blocks():
    async def main():
        workers = FakeWorkers(num_blocks=8, block_size=4, step_s=0.01)
        engine = Engine(workers, EngineConfig(watermark=0.0))
        await engine.start()
        big = make_request(20, max_tokens=12)      # 32 tokens: the whole pool by its end
        engine.submit(big)
        await _until(lambda: engine.scheduler.blocks.num_free <= 2)
        small = make_request(12, max_tokens=2, token=5)   # needs 3 blocks (no shared prefix): waits
        engine.submit(small)
        await asyncio.sleep(0.01)
        assert small.sequences[0].status is Status.WAITING and not big.finished
        engine.abort(big)
        assert await _until(lambda: small.sequences[0].status is not Status.WAITING, timeout=1.0) < 0.25
        await _until(lambda: small.finished)
        assert small.sequences[0].output_token_ids == [TOKEN, TOKEN]
        await engine.stop()
    asyncio.run(main())


def test_an_idle_engine_without_work_does_not_schedule():
    async def main():
        engine = Engine(FakeWorkers(), EngineConfig())
        await engine.start()
        calls = _count_schedules(engine)
        await asyncio.sleep(0.01)
        first = calls[0]
        await asyncio.sleep(0.05)
        assert calls[0] == first <= 1   # the loop's first look, then nothing until a submit
        req = make_request(3, max_tokens=2)
        engine.submit(req)
        await _until(lambda: req.finished, timeout=1.0)
        await engine.stop()
    asyncio.run(main())


def test_a_request_submitted_while_a_step_is_out_is_scheduled_at_once():
    """Nothing to schedule, a step in flight and room for another: a new request does not wait
    for that step's result (a slow one here) before it is scheduled."""
    async def main():
        workers = FakeWorkers(num_blocks=32, block_size=4, step_s=0.3)
        engine = Engine(workers, EngineConfig())
        await engine.start()
        first = make_request(4, max_tokens=2)   # two steps, then nothing to schedule until they end
        engine.submit(first)
        await _until(lambda: workers.steps == 2)
        await asyncio.sleep(0.02)
        second = make_request(6, max_tokens=2, token=5)
        engine.submit(second)
        waited = await _until(lambda: workers.steps == 3, timeout=1.0)
        assert waited < 0.15, f"the new request waited {waited:.3f} s for a step in flight"
        assert not first.finished   # (its steps' results had not come back)
        await _until(lambda: first.finished and second.finished)
        await engine.stop()
    asyncio.run(main())


def test_a_step_without_decodes_is_flushed_and_steps_with_decodes_are_not():
    class Flushes(FakeWorkers):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.flushes = []

        async def send(self, msg):
            if msg.new_seqs or msg.running_seq_ids:
                self.flushes.append(msg.flush)
            await super().send(msg)

    async def main():
        workers = Flushes(num_blocks=32, block_size=4)
        engine = Engine(workers, EngineConfig())
        await engine.start()
        req = make_request(4, max_tokens=5)
        engine.submit(req)
        await _until(lambda: req.finished)
        assert workers.flushes[0] is True           # the prompt alone: answered at once
        assert workers.flushes[1:] == [False] * 4   # decodes: the worker may hold them back
        await engine.stop()
    asyncio.run(main())


@pytest.mark.parametrize("interval, woken_at", [(5, [1, 6, 11, 12]), (12, [12]), (1, list(range(1, 13)))])
def test_the_first_token_wakes_its_request_whatever_the_stream_interval(interval, woken_at):
    """The first token goes out at once (TTFT); then every stream_interval tokens and at the
    end; a request that asked for its whole completion in one message gets one."""
    async def main():
        engine = Engine(FakeWorkers(num_blocks=32, block_size=4), EngineConfig())
        await engine.start()
        req = make_request(4, max_tokens=12)
        req.stream_interval = interval
        seq, woken = req.sequences[0], []

        def notify():   # a client that takes everything at every wake-up
            if seq.delivered < len(seq.output_token_ids):
                woken.append(len(seq.output_token_ids))
                seq.delivered = len(seq.output_token_ids)
        req.notify = notify
        engine.submit(req)
        await _until(lambda: req.finished)
        await asyncio.sleep(0.01)
        assert woken == woken_at
        await engine.stop()
    asyncio.run(main())


def test_an_error_in_the_loop_fails_its_requests_and_the_engine_serves_again():
    """A bug that raises inside the loop must not leave requests waiting forever with health
    SERVING: they fail with INTERNAL, the workers' streams are reopened from nothing, and the
    next request is served."""
    import grpc

    async def main():
        workers = FakeWorkers(num_blocks=16, block_size=4)
        engine = Engine(workers, EngineConfig(max_batched_tokens=8))
        await engine.start()
        schedule, raised = engine.scheduler.schedule, []

        def broken(*args):
            if not raised:
                raised.append(1)
                raise RuntimeError("a bug")
            return schedule(*args)
        engine.scheduler.schedule = broken
        first = make_request(5, max_tokens=4)
        engine.submit(first)
        await _until(lambda: first.failure is not None)
        assert first.failure.code == grpc.StatusCode.INTERNAL and "RuntimeError" in first.failure.message
        assert engine.scheduler.blocks.num_free == 16 and not engine.requests
        second = make_request(5, max_tokens=4)
        engine.submit(second)
        await _until(lambda: second.finished)
        assert second.sequences[0].output_token_ids == [TOKEN] * 4 and engine.healthy
        await engine.stop()
    asyncio.run(main())
