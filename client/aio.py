"""The asyncio client: the same calls as ``Client``, awaited (``stream`` is an async iterator).
Readiness is checked once, in a worker thread, with ``headrace.client.connection``'s probe."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable, Sequence

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from headrace.client import connection
from headrace.client.connection import ConnectionOptions, mapped_errors
from headrace.client.types import (Chunk, Collector, Completion, ModelInfo, Tokens, request_from,
                                   to_chunk, to_model_info, whole)


class AsyncClient:
    """``async with AsyncClient(address, ...) as client: await client.generate(...)``; see
    ``Client`` for the options."""

    def __init__(self, address: str | None = None, *, api_token: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 connect_timeout: float | None = None, session_id: str | None = None):
        self.options = ConnectionOptions.resolve(address, api_token=api_token, tls=tls, tls_ca=tls_ca,
                                                 tls_cert=tls_cert, tls_key=tls_key,
                                                 connect_timeout=connect_timeout, session_id=session_id)
        self._channel = None
        self._ready = False

    @property
    def _stub(self) -> pb_grpc.InferenceStub:
        if self._channel is None:   # made inside the running event loop
            self._channel = self.options.aio_channel()
        return pb_grpc.InferenceStub(self._channel)

    def _with_sync_channel(self, fn, *args):
        with self.options.channel() as channel:
            return fn(channel, self.options, *args)

    async def health(self) -> str:
        """The server's state: serving, loading, draining or down."""
        return (await asyncio.to_thread(self._with_sync_channel, connection.probe))[0]

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self._with_sync_channel, connection.wait_ready, timeout)
        self._ready = True

    async def _call_options(self, timeout: float | None, session_id: str | None = None) -> dict:
        if not self._ready:
            await self.wait_ready()
        return {"metadata": self.options.call_metadata(session_id), "timeout": timeout}

    async def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                       max_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                       repetition_penalty: float | None = None, presence_penalty: float | None = None,
                       frequency_penalty: float | None = None, seed: int | None = None,
                       logit_bias: dict[int, float] | None = None,
                       min_tokens: int | None = None, stop: str | Iterable[str] | None = None,
                       stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                       priority: int | None = None, logprobs: int | None = None, n: int | None = None,
                       stream_interval: int | None = None, request_id: str | None = None,
                       json_schema: dict[str, Any] | str | None = None, regex: str | None = None,
                       choice: Sequence[str] | None = None, grammar: str | None = None,
                       json_object: bool = False, structured_backend: str | None = None,
                       model: str | None = None,
                       timeout: float | None = None,
                       session_id: str | None = None) -> Completion | list[Completion]:
        request = whole(request_from(locals()))
        collector = Collector()
        options = await self._call_options(timeout, session_id)
        with mapped_errors():
            async for msg in self._stub.Generate(request, **options):
                collector.add(to_chunk(msg))
        return collector.result(request.n)

    def stream(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
               max_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None, seed: int | None = None,
               logit_bias: dict[int, float] | None = None,
               min_tokens: int | None = None, stop: str | Iterable[str] | None = None,
               stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
               priority: int | None = None, logprobs: int | None = None, n: int | None = None,
               stream_interval: int | None = None, request_id: str | None = None,
               json_schema: dict[str, Any] | str | None = None, regex: str | None = None,
               choice: Sequence[str] | None = None, grammar: str | None = None,
               json_object: bool = False, structured_backend: str | None = None,
               model: str | None = None,
               timeout: float | None = None, session_id: str | None = None) -> AsyncIterator[Chunk]:
        """An async iterator of chunks (``Client.stream``'s options); a misspelt option is a
        TypeError here, at the call."""
        return self._stream(request_from(locals()), timeout, session_id)

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None,
                      session_id: str | None) -> AsyncIterator[Chunk]:
        options = await self._call_options(timeout, session_id)
        call = self._stub.Generate(request, **options)
        try:
            with mapped_errors():
                async for msg in call:
                    yield to_chunk(msg)
        finally:
            call.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = False,
                       timeout: float | None = None) -> Tokens:
        options = await self._call_options(timeout)
        with mapped_errors():
            resp = await self._stub.Tokenize(
                pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens), **options)
        return Tokens(list(resp.token_ids), list(resp.tokens))

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        options = await self._call_options(timeout)
        with mapped_errors():
            return to_model_info(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), **options))

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
