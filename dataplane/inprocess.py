"""A data plane worker as an in-process worker group: the interface the control plane's engine
drives (``describe``, ``num_kv_blocks``, ``open``, ``send``, ``receive``, ``close_streams``,
``close``, ``broken``) over a ``Worker`` in this process, with the same step pipeline as the
data plane's ``Execute`` stream (step N+1 launched before step N is finished) and no gRPC in
between.

The planes never import each other; code above both (benchmarks, tests) composes them:

    engine = Engine(InProcessWorkerGroup(Worker(WorkerOptions(model=...))), EngineConfig())

``launch_hook(step, launch)`` (optional) wraps each step's launch: it must call ``launch()``
once and return its result, so a caller can time or profile the runner's host work without
reaching into it. ``send`` returns the results its step made ready, in step order.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

from headrace.dataplane.pipeline import StepPipeline
from headrace.dataplane.launched import Launched
from headrace.dataplane.worker import Worker
from headrace.worker.v1 import worker_pb2 as pb

LaunchHook = Callable[[pb.StepRequest, Callable[[], Launched]], Launched]


class InProcessWorkerGroup:
    """One worker, one rank; its results come back in the order the steps were sent."""

    broken = False   # an in-process stream never ends by itself

    def __init__(self, worker: Worker, launch_hook: LaunchHook | None = None):
        self.worker = worker
        self.infos: list[pb.WorkerInfo] = []
        self._hook = launch_hook
        self._ready: collections.deque[pb.StepResult] = collections.deque()
        self._pipeline = self._new_pipeline()

    def _new_pipeline(self) -> StepPipeline:
        runner = self.worker.runner
        if self._hook is None:
            return StepPipeline(runner)
        return StepPipeline(runner, launch=lambda step: self._hook(step, lambda: runner.launch(step)))

    async def describe(self, timeout: float) -> list[pb.WorkerInfo]:
        self.infos = [self.worker.describe()]
        return self.infos

    async def load_adapter(self, adapter_id: int, path: str) -> pb.LoadAdapterResponse:
        """The worker reads a LoRA adapter into its host cache (on a thread, as the RPC runs
        beside the steps); ``ValueError`` with the reason when it cannot."""
        request = pb.LoadAdapterRequest(adapter_id=adapter_id, path=path)
        return await asyncio.to_thread(self.worker.load_adapter, request)

    async def drop_adapters(self, adapter_ids: list[int], below: int = 0) -> None:
        if self.worker.lora is not None:
            self.worker.lora.slots.drop(adapter_ids, below)

    @property
    def num_kv_blocks(self) -> int:
        return self.infos[0].num_kv_blocks

    async def open(self) -> None:
        """A fresh step stream: the worker forgets every sequence, as on a new ``Execute``."""
        self.worker.runner.reset()
        self._pipeline = self._new_pipeline()
        self._ready.clear()

    async def close_streams(self) -> None:
        """Ends the stream: what is still in flight is finished and dropped."""
        self._pipeline.drain()
        self._ready.clear()

    async def send(self, step: pb.StepRequest) -> list[pb.StepResult]:
        """Launches ``step`` (on this thread); returns the results that became ready."""
        ready = self._pipeline.submit(step)
        while self._pipeline.deferred is not None:   # (its answers are out: queued here)
            ready += self._pipeline.resume()
        self._ready.extend(ready)
        return ready

    async def receive(self) -> pb.StepResult:
        """The oldest result not yet received. Yields to the event loop first, as a remote
        step in flight would let the clients' tasks run."""
        await asyncio.sleep(0)
        if not self._ready:
            raise RuntimeError("no step result is ready: the last step sent must flush")
        return self._ready.popleft()

    async def close(self) -> None:
        await self.close_streams()
