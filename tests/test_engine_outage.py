"""The engine through a data plane outage (controlplane/engine/loop.py's ``_reconnect``), with
stand-in workers that go down on demand: requests kept through the outage fail with
UNAVAILABLE once it outlasts ``outage_deadline_s``, and so does one handed to the engine
later in the same outage (a front end checks readiness, then awaits tokenization: the
outage can begin in between)."""

from __future__ import annotations

import asyncio

import grpc

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.engine.worker_client import WorkerError, WorkerGroup
from tests.test_engine_loop import FakeWorkers, _until, make_request


class WorkersThatGoDown(FakeWorkers):
    down = False

    @property
    def broken(self) -> bool:
        return self.down

    async def describe(self, timeout: float):
        if self.down:
            await asyncio.sleep(min(timeout, 0.05))
            raise WorkerError("data plane not ready")
        return await super().describe(timeout)

    async def send(self, msg) -> None:
        if self.down:
            raise WorkerError("data plane stream closed")
        await super().send(msg)


def test_a_request_kept_through_the_outage_and_one_arriving_after_its_deadline_both_fail():
    async def main():
        workers = WorkersThatGoDown(num_blocks=16, block_size=4)
        engine = Engine(workers, EngineConfig(outage_deadline_s=0.3, reconnect_interval_s=0.05))
        await engine.start()
        workers.down = True
        kept = make_request(5, max_tokens=4)
        engine.submit(kept)                      # its step finds the stream closed
        await _until(lambda: not engine.healthy)
        assert await _until(lambda: kept.failure is not None, timeout=3.0) < 1.5
        assert kept.failure.code == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(0.5)                 # the outage goes on past its deadline
        late = make_request(5, max_tokens=4)
        engine.submit(late)
        assert await _until(lambda: late.failure is not None, timeout=3.0) < 1.0, \
            "a request handed over later in the outage waited for the data plane"
        assert late.failure.code == grpc.StatusCode.UNAVAILABLE
        assert "data plane unavailable for more than 0.3s" in late.failure.message
        assert not engine.requests and engine.scheduler.blocks.num_free == 16
        workers.down = False                     # back: the engine serves again
        await _until(lambda: engine.healthy)
        again = make_request(5, max_tokens=3)
        engine.submit(again)
        await _until(lambda: again.finished)
        assert again.failure is None
        await engine.stop()
    asyncio.run(main())


def test_a_step_stream_to_a_data_plane_gone_before_it_opened_ends_at_once():
    """A data plane that goes away between ``describe`` and ``open`` (a crash right after a
    reconnect): its step stream fails at once, so the engine sees the outage. Waiting for the
    channel to be ready, it stayed open with every step unanswered and health SERVING, and a
    request waited for its client's deadline (test_dataplane's outage test, under load)."""
    import socket
    import time

    with socket.socket() as sock:          # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"

    async def main():
        group = WorkerGroup([address])
        try:
            await group.open()
            t0 = time.monotonic()
            while not group.broken and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.02)
            assert group.broken, "the step stream to a data plane that is not there stayed open"
            try:
                await asyncio.wait_for(group.receive(), 5)
            except WorkerError:
                pass
            else:
                raise AssertionError("a step result came from no data plane")
        finally:
            await group.close()

    asyncio.run(main())
