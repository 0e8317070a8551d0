"""The synchronous client: ``Client(address, api_token=..., tls_ca=...)`` then ``generate``,
``stream``, ``tokenize``, ``model_info`` and ``health``. The first call waits (up to the
connect timeout) for the server to be ready and raises ``NotReady`` naming its state."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from headrace.client import connection
from headrace.client.connection import ConnectionOptions, mapped_errors
from headrace.client.types import (Chunk, Collector, Completion, ModelInfo, Tokens, request_from,
                                   to_chunk, to_model_info, whole)


class Client:
    """A connection to one headrace server. Options: ``address`` (``host:port``), ``api_token``,
    ``tls`` / ``tls_ca`` / ``tls_cert`` / ``tls_key``, ``connect_timeout``, ``session_id`` (a
    load balancer's affinity key); unset ones come from ``HEADRACE_*`` environment variables
    (see ``headrace.client.connection``).
    Sampling options of ``generate``/``stream`` are ``GenerateRequest``'s fields, as keyword
    parameters (a misspelt one is a TypeError at the call); an option not given takes the
    server's default."""

    def __init__(self, address: str | None = None, *, api_token: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 connect_timeout: float | None = None, session_id: str | None = None):
        self.options = ConnectionOptions.resolve(address, api_token=api_token, tls=tls, tls_ca=tls_ca,
                                                 tls_cert=tls_cert, tls_key=tls_key,
                                                 connect_timeout=connect_timeout, session_id=session_id)
        self._channel = self.options.channel()
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._ready = False

    # -- connection --------------------------------------------------------------------------
    def health(self) -> str:
        """The server's state: serving, loading, draining or down."""
        return connection.probe(self._channel, self.options)[0]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits for the server to serve; NotReady (with ``state``) after ``timeout``."""
        connection.wait_ready(self._channel, self.options, timeout)
        self._ready = True

    def _call_options(self, timeout: float | None, session_id: str | None = None) -> dict:
        if not self._ready:
            self.wait_ready()
        return {"metadata": self.options.call_metadata(session_id), "timeout": timeout}

    # -- calls -------------------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
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
        """The whole completion (one message from the server); a list of ``n`` when n > 1.
        Options left None take the server's defaults (``GenerateRequest``'s fields). Structured
        outputs: at most one of ``json_schema`` (a dict or its JSON text), ``regex``, ``choice``,
        ``grammar`` (GBNF) or ``json_object``; ``structured_backend`` names the server's grammar
        engine to use (default: its own). ``model``: a LoRA adapter the server serves, by name
        (default: the base model). ``session_id``: this call's affinity key (default: the
        client's)."""
        request = whole(request_from(locals()))
        collector = Collector()
        with mapped_errors():
            for msg in self._stub.Generate(request, **self._call_options(timeout, session_id)):
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
               timeout: float | None = None, session_id: str | None = None) -> Iterator[Chunk]:
        """Chunks as the server sends them; leaving the loop early cancels the request. The
        options are ``generate``'s."""
        return self._stream(request_from(locals()), timeout, session_id)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None,
                session_id: str | None) -> Iterator[Chunk]:
        call = None
        try:
            with mapped_errors():
                call = self._stub.Generate(request, **self._call_options(timeout, session_id))
                for msg in call:
                    yield to_chunk(msg)
        finally:
            if call is not None:
                call.cancel()

    def tokenize(self, text: str, add_special_tokens: bool = False,
                 timeout: float | None = None) -> Tokens:
        with mapped_errors():
            resp = self._stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                       **self._call_options(timeout))
        return Tokens(list(resp.token_ids), list(resp.tokens))

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        with mapped_errors():
            return to_model_info(self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                         **self._call_options(timeout)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Client"]
