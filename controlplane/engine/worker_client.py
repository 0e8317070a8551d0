"""The control plane's side of the step protocol: one group of data plane workers that form
one model. Every step goes to every worker; rank 0 answers with the sampled tokens."""

from __future__ import annotations

import asyncio
import time

import grpc

from headrace.common import security
from headrace.common.grpc_options import channel_options
from headrace.worker.v1 import worker_pb2 as pb
from headrace.worker.v1 import worker_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = channel_options()


class WorkerError(RuntimeError):
    """A worker stream broke or a worker answered with an error (``code``: its status, when
    it answered one)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


def _tracing_interceptors() -> list:
    """OpenTelemetry client interceptors for Describe/Reload (the Execute stream carries its
    trace context per step instead); none when tracing is off."""
    from headrace.common import tracing

    provider = tracing.tracer_provider()
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

    return aio_client_interceptors(tracer_provider=provider,
                                   filter_=filters.negate(filters.method_name("Execute")))


def _one_model(infos: list[pb.WorkerInfo]) -> list[pb.WorkerInfo]:
    """The workers' infos, when they all serve one model with one block size."""
    if len({(i.model_name, i.block_size, i.vocab_size) for i in infos}) > 1:
        raise WorkerError("workers of one group serve different models or block sizes")
    return infos


async def _drain(queue: asyncio.Queue):
    """An Execute stream's requests: the steps ``WorkerGroup.send`` queues, in order, until
    ``None`` (the stream is closed)."""
    while (step := await queue.get()) is not None:
        yield step


class WorkerGroup:
    def __init__(self, addresses: list[str], credentials: grpc.ChannelCredentials | None = None,
                 secret: str | None = None):
        if not addresses:
            raise ValueError("at least one data plane address is needed")
        self.addresses = addresses
        interceptors = _tracing_interceptors() or None
        self._metadata = security.bearer_metadata(secret)
        self._channels = [grpc.aio.secure_channel(a, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors)
                          if credentials is not None and not a.startswith("unix:") else
                          grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS, interceptors=interceptors)
                          for a in addresses]
        self._stubs = [pb_grpc.WorkerStub(c) for c in self._channels]
        self._calls: list = []
        self._queues: list[asyncio.Queue] = []
        self.infos: list[pb.WorkerInfo] = []
        self.on_stream_end = None   # called when an open Execute stream ends by itself

    async def describe(self, timeout: float) -> list[pb.WorkerInfo]:
        """Waits (up to ``timeout`` seconds) until every worker answers Describe."""
        deadline = time.monotonic() + timeout
        infos = []
        for addr, stub in zip(self.addresses, self._stubs):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(f"data plane at {addr} not ready after {timeout:.0f}s")
                try:
                    infos.append(await stub.Describe(pb.DescribeRequest(), timeout=min(left, 5.0),
                                                     metadata=self._metadata,
                                                     wait_for_ready=True))
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise WorkerError(f"Describe on {addr}: {exc.details()}") from exc
                    await asyncio.sleep(0.2)
        self.infos = _one_model(infos)
        return self.infos

    async def reload(self, model: str, timeout: float = 1800.0) -> list[pb.WorkerInfo]:
        """Asks every worker to load ``model`` (in parallel); a worker that fails puts its
        previous model back. Raises WorkerError when any failed."""
        async def one(addr, stub):
            try:
                return await stub.Reload(pb.ReloadRequest(model=model), timeout=timeout,
                                         metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                raise WorkerError(f"Reload on {addr}: {exc.code().name}: {exc.details()}") from exc

        infos = await asyncio.gather(*(one(a, s) for a, s in zip(self.addresses, self._stubs)))
        self.infos = _one_model(list(infos))
        return self.infos

    async def load_adapter(self, adapter_id: int, path: str,
                           timeout: float = 600.0) -> pb.LoadAdapterResponse:
        """Every worker reads a LoRA adapter into its host cache (in parallel); WorkerError
        with the first refusal."""
        request = pb.LoadAdapterRequest(adapter_id=adapter_id, path=path)

        async def one(addr, stub):
            try:
                return await stub.LoadAdapter(request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                raise WorkerError(exc.details() or f"LoadAdapter on {addr}: {exc.code().name}",
                                  exc.code()) from exc

        answers = await asyncio.gather(*(one(a, s) for a, s in zip(self.addresses, self._stubs)))
        return answers[0]

    async def drop_adapters(self, adapter_ids: list[int], below: int = 0) -> None:
        request = pb.DropAdaptersRequest(adapter_ids=adapter_ids, below_id=below)
        await asyncio.gather(*(stub.DropAdapters(request,
                                                 timeout=30, metadata=self._metadata)
                               for stub in self._stubs))

    @property
    def num_kv_blocks(self) -> int:
        """KV capacity of the group: the smallest of its workers'."""
        return min(i.num_kv_blocks for i in self.infos)

    async def open(self) -> None:
        """Opens fresh Execute streams (each worker then starts from an empty mirror). They do
        not wait for a channel to be ready (``describe`` just found it so): a data plane gone
        in between fails its stream at once, which the engine sees as an outage, where a
        stream waiting for the channel would stay open, and every step sent on it unanswered,
        until that data plane came back."""
        await self.close_streams()
        self._queues = [asyncio.Queue() for _ in self._stubs]
        self._calls = [stub.Execute(_drain(queue), metadata=self._metadata)
                       for stub, queue in zip(self._stubs, self._queues)]
        for call in self._calls:
            call.add_done_callback(self._stream_ended)

    def _stream_ended(self, call) -> None:
        if call in self._calls and self.on_stream_end is not None:   # (not one closed here)
            self.on_stream_end()

    @property
    def broken(self) -> bool:
        """Whether an open step stream ended (its worker gone), even with no step in flight."""
        return any(call.done() for call in self._calls)

    async def close_streams(self) -> None:
        for queue in self._queues:   # each stream's writer ends ...
            queue.put_nowait(None)
        for call in self._calls:     # ... and the call with it
            call.cancel()
        self._calls, self._queues = [], []

    async def send(self, request: pb.StepRequest) -> None:
        """Sends a step to every worker (their results come back in order, see ``receive``).
        The step is queued for each stream's writer (gRPC's own task): the engine does not
        wait for the write to complete; a stream that broke fails here or at ``receive``."""
        if not self._calls:
            raise WorkerError("no open step stream")
        for call, queue in zip(self._calls, self._queues):
            if call.done():
                raise WorkerError("data plane stream closed")
            queue.put_nowait(request)

    async def receive(self) -> pb.StepResult:
        """The result of the oldest step sent and not yet received (rank 0's answer)."""
        try:
            results = []
            for call in self._calls:
                results.append(await call.read())
                if results[-1] is not grpc.aio.EOF and results[-1].HasField("error"):
                    return results[-1]   # a rank's step raised: the others' answers do not matter
        except grpc.aio.AioRpcError as exc:
            raise WorkerError(f"data plane step failed: {exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError as exc:
            raise WorkerError(f"data plane stream closed: {exc}") from exc
        if any(r is grpc.aio.EOF for r in results):
            raise WorkerError("data plane closed its step stream")
        for other in results[1:]:   # a profile's end: every rank's report, in rank 0's result
            if other.profile_reports:
                results[0].profile_reports.extend(other.profile_reports)
        return results[0]

    async def alive(self, timeout: float) -> bool:
        """Whether every worker answers a health check within ``timeout`` seconds (a stopped
        or wedged process does not; one busy with a long step does: its server threads do)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async def one(channel):
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                timeout=timeout)
                return True
            except grpc.aio.AioRpcError:
                return False

        return all(await asyncio.gather(*(one(c) for c in self._channels)))

    async def close(self) -> None:
        await self.close_streams()
        for channel in self._channels:
            await channel.close()
