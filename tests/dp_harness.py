"""Data-parallel engine cores in the test process, as ``headrace serve --data-parallel-size``
runs them: a data plane worker per core (unix sockets), the cores (``CoreServer``) and any
number of API front ends over them (each with its own placement, or over one core only), in
one event-loop thread. Cores and data planes can be stopped and started again to play a lost
one."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading

import grpc

from headrace.controlplane.core.server import CoreServer
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.frontend.server import FrontEnd
from headrace.controlplane.frontend.placement import Placement
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.server import serve
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

MODEL = str(default_model_dir())


class Cores:
    def __init__(self, count: int = 2, num_kv_blocks: int = 256, config: EngineConfig | None = None):
        self.tmp = tempfile.mkdtemp(prefix="headrace-dp-")
        self.config = config
        self.workers = [Worker(WorkerOptions(model=MODEL, num_kv_blocks=num_kv_blocks, device="cpu",
                                             dtype="float32", max_num_seqs=64)) for _ in range(count)]
        self.worker_addresses = [f"unix:{self.tmp}/dp-{i}.sock" for i in range(count)]
        self.worker_servers = [serve(w, a) for w, a in zip(self.workers, self.worker_addresses)]
        self.addresses = [f"unix:{self.tmp}/core-{i}.sock" for i in range(count)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cores = [self.call(self._core(i)) for i in range(count)]
        self.frontends: list[FrontEnd] = []
        self.channels: list[grpc.Channel] = []

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _core(self, i: int) -> CoreServer:
        # (no core secret here: Admin on loopback is opted into, as a front end's test asks)
        core = CoreServer(MODEL, [self.worker_addresses[i]], self.addresses[i], self.config,
                          admin_insecure_loopback=True, data_parallel_rank=i,
                          data_parallel_size=len(self.addresses))
        await core.start(ready_timeout=120)
        return core

    def frontend(self, placement: str = "prefix", cores: list[int] | None = None, **options):
        """A front end over ``cores`` (default all); returns its Inference stub."""
        addresses = [self.addresses[i] for i in (cores if cores is not None else range(len(self.addresses)))]

        async def build():
            fe = FrontEnd(len(self.frontends), addresses, MODEL, "127.0.0.1:0", reuse_port=False,
                          placement=Placement(placement), **options)
            await fe.start()
            # every core's stream up (a core just restarted: its connection out of back-off)
            while not all(c.ready for c in getattr(fe.client, "clients", [fe.client])):
                await asyncio.sleep(0.01)
            return fe

        fe = self.call(build())
        self.frontends.append(fe)
        channel = grpc.insecure_channel(f"127.0.0.1:{fe.port}")
        self.channels.append(channel)
        return pb_grpc.InferenceStub(channel)

    def stop_core(self, i: int) -> None:
        self.call(self.cores[i].stop(grace=0))

    def start_core(self, i: int) -> None:
        self.cores[i] = self.call(self._core(i))

    def stop_worker(self, i: int) -> None:
        self.worker_servers[i].stop(0).wait()

    def start_worker(self, i: int) -> None:
        self.worker_servers[i] = serve(self.workers[i], self.worker_addresses[i])

    def prefix_hits(self, i: int) -> int:
        return self.cores[i].engine.scheduler.blocks.prefix_hits

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for fe in self.frontends:
            with contextlib.suppress(Exception):
                self.call(fe.stop(grace=1))
        for core in self.cores:
            with contextlib.suppress(Exception):
                self.call(core.stop(grace=1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for server in self.worker_servers:
            server.stop(0).wait()
        shutil.rmtree(self.tmp, ignore_errors=True)   # (issue 30: no temporary directory left)


def generate(stub, ids: list[int], max_tokens: int = 4, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0), **fields), timeout=120))
