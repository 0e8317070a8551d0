"""The transport-neutral request path every public API shares (gRPC ``Inference`` and the
OpenAI-compatible HTTP API): readiness, queue limit, sampling defaults, chat rendering, validation,
duplicate ids, tracing, per-API metrics, submission, streaming and abort-on-exit; the per-request
admission bounds (``headrace.controlplane.requests.limits``: text size, ``n``, queue) and the
client's tenant (its API token, or a trusted ``x-headrace-tenant`` header); the client-facing TTFT,
ITL and e2e latency of each stream (``headrace.controlplane.requests.stream_latency``).

Tokenization and chat rendering of long texts run off the event loop
(``headrace.controlplane.requests.tokenizer.off_loop``), after every cheap check passed, so one
client's prompt never delays another's tokens; a text is tokenized only as far as ``max_model_len``
tokens can reach (``ModelTokenizer.encode_within``), so one that can never fit costs no more. Every
stream that ends before its last response (client cancel, deadline, disconnect, server abort) is
logged and counted with its reason.

``generate`` yields ``GenerateResponse`` messages and raises ``RequestError`` (a gRPC status code
and a message) for every refusal; each transport maps it to its own status. A consumer that stops
iterating (client gone) closes the generator, which aborts the request and frees its blocks.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import AsyncIterator, Iterable

import grpc
import structlog
from opentelemetry import trace

from headrace.common import failpoints, stage_times, tracing
from headrace.controlplane.lora import api as lora_api
from headrace.common.logs import get_logger
from headrace.common.security import DEFAULT_TENANT, ApiTokens
from headrace.controlplane.requests import chat_input, limits
from headrace.controlplane.requests.chat_template import ChatTemplate, ChatTemplateError
from headrace.controlplane.engine.loop import Engine
from headrace.controlplane.requests.sampling_defaults import SamplingDefaults
from headrace.controlplane.requests.stream_latency import StreamLatency
from headrace.controlplane.requests.tokenizer import INLINE_CHARS, ModelTokenizer, TooLong, off_loop
from headrace.controlplane.requests.validation import (ValidationError, build_request,
                                                       check_request, check_text)
from headrace.v1 import inference_pb2 as pb

log = get_logger("headrace.request")
TENANT_HEADER = "x-headrace-tenant"


class RequestError(Exception):
    """A request refused or ended by the server: ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _aborted(req) -> bool:
    return any(s.finish_reason == pb.FINISH_REASON_ABORTED for s in req.sequences)


class RequestPath:
    """What the front ends call. ``set_model`` swaps tokenizer, chat template and sampling
    defaults together (start-up, Admin reload)."""

    def __init__(self, engine: Engine, model_dir: str, tokenizer: ModelTokenizer, *,
                 chat_template: str | None = None, generation_config: str = "auto",
                 log_prompts: bool = False, tokens: ApiTokens | None = None,
                 trust_tenant_header: bool = False, max_n: int = limits.DEFAULT_MAX_N,
                 max_prompts: int = limits.DEFAULT_MAX_PROMPTS):
        self.engine = engine
        self.log_prompts = log_prompts
        self.tokens, self.trust_tenant_header = tokens or ApiTokens(), trust_tenant_header
        self.max_n, self.max_prompts = max_n, max_prompts
        self.chat_template_file = chat_template
        self.generation_config = generation_config
        self.tracer = tracing.get_tracer("headrace.controlplane")   # None: tracing off
        self.active: set = set()        # requests whose stream is open (``headrace.controlplane.shutdown``)
        self.shutting_down = False      # no request is admitted any more
        self.set_model(model_dir, tokenizer)

    def load_assets(self, model_dir: str) -> tuple[ChatTemplate | None, SamplingDefaults]:
        """The model's chat template and sampling defaults; ValueError when the template is
        unreadable or does not compile (Admin reload checks this before draining)."""
        try:
            template = ChatTemplate.load(model_dir, self.chat_template_file)
        except (OSError, ChatTemplateError) as exc:
            raise ValueError(f"chat template of {model_dir}: {exc}") from exc
        return template, SamplingDefaults.load(model_dir, self.generation_config)

    def set_model(self, model_dir: str, tokenizer: ModelTokenizer) -> None:
        self.chat_template, self.defaults = self.load_assets(model_dir)
        self.model_dir, self.tokenizer = model_dir, tokenizer
        self.model_name = pathlib.Path(model_dir).resolve().name

    # -- readiness -------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.shutting_down:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica")
        if self.engine.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        if not self.engine.healthy or self.engine.scheduler is None:
            why = getattr(self.engine, "trouble", None) or "loading or data plane down"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model is not ready ({why})")

    def base_names(self) -> set[str]:
        """The names a request's ``model`` may give the base model by."""
        info = self.engine.info
        return {self.model_name, self.model_dir} | ({info.model_name} if info is not None else set())

    def lora_of(self, model: str) -> str:
        """The LoRA adapter ``model`` names ("" for the base model); RequestError NOT_FOUND
        for an unknown name (INVALID_ARGUMENT for an adapter the data planes refused)."""
        try:
            return lora_api.lora_of(model, self.base_names(), self.engine, self.model_name)
        except lora_api.ModelNotFound as exc:
            raise RequestError(exc.code, exc.message) from None
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def check_loaded(self) -> None:
        """The model is there (answers while draining): model info, tokenization."""
        if not self.engine.healthy or self.engine.info is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)")

    @property
    def max_text_bytes(self) -> int:
        """The longest text worth tokenizing for the served model
(``headrace.controlplane.requests.limits``)."""
        return limits.max_text_bytes(self.engine.max_model_len, self.tokenizer.max_token_bytes)

    @property
    def prompt_limit(self) -> int:
        """The most tokens a prompt may have (one output token must fit)."""
        return max(self.engine.max_model_len - 1, 0)

    def _too_long(self, name: str, exc: TooLong, limit: int | None = None) -> str:
        limit = self.prompt_limit if limit is None else limit
        return (f"{name} has more than {limit} tokens (at least {exc.at_least}); "
                f"max_model_len is {self.engine.max_model_len} (counted without tokenizing all of it)")

    def tenant_of(self, metadata: Iterable[tuple[str, str]]) -> str:
        """The caller's tenant: a trusted ``x-headrace-tenant`` header, else its API token's."""
        headers = dict(metadata)
        if self.trust_tenant_header and headers.get(TENANT_HEADER):
            return headers[TENANT_HEADER][:64]
        if self.tokens:
            return self.tokens.tenant(headers.get("authorization")) or DEFAULT_TENANT
        return DEFAULT_TENANT

    # -- input -----------------------------------------------------------------------------
    def check_chat(self, chat: pb.ChatMessages) -> int:
        """The cheap checks of a conversation; returns its size in characters."""
        return chat_input.check(chat, self.chat_template, self.max_text_bytes)

    def render_chat(self, chat: pb.ChatMessages) -> list[int]:
        """The prompt ids of a conversation: rendered with the chat template and tokenized
        without adding special tokens (the template writes them), as far as a prompt may go."""
        text = chat_input.render(chat, self.chat_template, self.max_text_bytes)
        try:
            return self.tokenizer.encode_within(text, self.prompt_limit, add_special_tokens=False)
        except TooLong as exc:
            raise ValidationError(self._too_long("messages", exc)) from None

    async def chat_ids(self, chat: pb.ChatMessages) -> list[int]:
        """``render_chat`` off the event loop when the conversation is long (ValidationError)."""
        if self.check_chat(chat) <= INLINE_CHARS:
            return self.render_chat(chat)
        return await off_loop(self.render_chat, chat)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The Tokenize RPC and HTTP /tokenize: bounded like a prompt, encoded off the loop."""
        try:
            check_text("text", text, self.max_text_bytes)
            return await self.tokenizer.encode_within_async(text, self.engine.max_model_len,
                                                            add_special_tokens)
        except ValidationError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except TooLong as exc:
            message = self._too_long("text", exc, self.engine.max_model_len)
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message) from None

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        kind = request.WhichOneof("input")
        if kind == "messages":
            return await self.chat_ids(request.messages)
        if kind == "prompt":
            try:
                return await self.tokenizer.encode_within_async(request.prompt, self.prompt_limit)
            except TooLong as exc:
                raise ValidationError(self._too_long("prompt", exc)) from None
        return None   # token ids: build_request takes them as they are

    # -- generation ------------------------------------------------------------------------
    async def generate(self, request: pb.GenerateRequest, *, api: str = "grpc",
                       method: str = "Generate", metadata: Iterable[tuple[str, str]] = (),
                       span_name: str | None = None,
                       gone_reason=lambda: "disconnect") -> AsyncIterator[pb.GenerateResponse]:
        """Streams the request's responses. ``api``/``method`` label the metrics; ``metadata``:
        the caller's headers (``traceparent``, the tenant's token or header); ``span_name``:
        open a server span (front ends without tracing instrumentation); ``gone_reason()``: why
        the consumer stopped early, as the front end knows it (client_cancel, deadline,
        disconnect)."""
        metadata = list(metadata)
        metrics = self.engine.telemetry.metrics
        latency = StreamLatency(metrics)   # received now: TTFT counts tokenisation too
        stages = stage_times.STAGES   # a benchmark's timestamps of the first token (None: off)
        if stages is not None:
            stages.stamp(request.request_id, "fe_received")
        metrics.api_request(api, method)
        tracer = self.tracer if span_name else None
        with contextlib.ExitStack() as stack:
            if tracer is not None:
                stack.enter_context(tracer.start_as_current_span(
                    span_name, context=tracing.extract(dict(metadata)), kind=trace.SpanKind.SERVER,
                    record_exception=False, set_status_on_exception=False))
            structlog.contextvars.bind_contextvars(request_id=request.request_id,
                                                   trace_id=tracing.request_trace_id(metadata))
            try:
                req = await self._admit(request, self.tenant_of(metadata))
            except RequestError as exc:
                self._failed(api, method, exc)
                raise
            reason = None
            self.active.add(req)
            try:
                while not req.delivered:
                    responses = await req.next_responses()
                    if req.failure is not None:
                        raise RequestError(req.failure.code, req.failure.message)
                    now = latency.handing(responses)
                    if stages is not None and responses:   # the first response, only
                        stages.stamp(req.request_id, "fe_first_response")
                        stages = None
                    if req.delivered and not _aborted(req):
                        latency.finished(now)
                    if failpoints.ACTIVE:
                        failpoints.hit("frontend.stream", request_id=req.request_id)
                    for msg in responses:
                        yield msg
            except RequestError as exc:
                # a refusal after submission (a grammar that does not compile) abandons nothing
                reason = "refused" if exc.code == grpc.StatusCode.INVALID_ARGUMENT else "server_abort"
                self._failed(api, method, exc)
                raise
            except Exception as exc:   # a bug while streaming: this stream fails with a status
                log.error("stream failed", error=type(exc).__name__, exc_info=exc)
                reason, error = "server_abort", RequestError(
                    grpc.StatusCode.INTERNAL, f"internal error in the front end ({type(exc).__name__}); "
                                              "the request was not completed")
                self._failed(api, method, error)
                raise error from None
            finally:
                if reason is None and not req.delivered:
                    reason = gone_reason()
                elif reason is None and _aborted(req):
                    reason = "server_abort"   # drained or reloaded: a last ABORTED response
                if reason not in (None, "refused"):
                    self._abandoned(req, api, reason)
                self.active.discard(req)
                self.engine.abort(req)   # no-op when finished; frees the blocks when the client left

    def check_queue(self, weight: int = 1) -> None:
        """RequestError unless ``weight`` more sequences fit the queue bound now (in one
        process the engine's own count; in a front end the core's, pushed on every change,
        and the core decides again on submission)."""
        refusal = limits.queue_refusal(self.engine.max_queued, self.engine.scheduler.num_queued, weight)
        if refusal:
            raise RequestError(*refusal)

    def check_batch(self, prompts: int, n: int) -> None:
        """The bounds of an HTTP body of ``prompts`` prompts of ``n`` samples each: at most
        ``max_prompts`` prompts, ``max_n`` sequences in all, and room in the queue for them."""
        if prompts > self.max_prompts:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt: at most {self.max_prompts} prompts per request (the server's "
                               f"--max-prompts-per-request), got {prompts}")
        if prompts * n > self.max_n:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"n x prompts must be at most {self.max_n} sequences per request (the "
                               f"server's --max-n), got {n} x {prompts}")
        self.check_ready()
        self.check_queue(prompts * max(n, 1))

    async def _admit(self, request: pb.GenerateRequest, tenant: str):
        engine = self.engine
        weight = max(request.n, 1)
        self.check_ready()
        self.check_queue(weight)
        request = self.defaults.apply(request)
        lora = self.lora_of(request.model)
        try:   # every cheap check first: refused requests cost no tokenization
            check_request(request, vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                          max_n=self.max_n, max_text_bytes=self.max_text_bytes)
            ids = await self._prompt_ids(request)
            self.check_ready()   # a drain or reload may have begun meanwhile
            self.check_queue(weight)
            req = build_request(request, self.tokenizer, seq_ids=engine.seq_ids, ids=ids,
                                vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                                eos_token_ids=list(engine.info.eos_token_ids), max_n=self.max_n,
                                default_max_tokens=self.defaults.max_tokens, tenant=tenant,
                                checked=True, deterministic=engine.info.deterministic)
            req.lora_name = lora
        except ValidationError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if req.request_id in engine.requests:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id {req.request_id!r} is already in use")
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        if self.log_prompts:
            log.info("request received", prompt=request.prompt or None, tenant=tenant,
                     prompt_token_ids=list(req.sequences[0].prompt_token_ids))
        engine.submit(req)
        if stage_times.STAGES is not None:
            stage_times.STAGES.stamp(req.request_id, "fe_submitted")
        return req

    def _abandoned(self, req, api: str, reason: str) -> None:
        self.engine.telemetry.metrics.abandoned(reason)
        log.info("request abandoned", reason=reason, api=api, tenant=req.tenant,
                 completion_tokens=sum(len(s.output_token_ids) for s in req.sequences))

    def _failed(self, api: str, method: str, exc: RequestError) -> None:
        self.engine.telemetry.metrics.rpc_error(method, exc.code, api)
        tracing.mark_span_failed(exc.code)
        log.info("request failed", code=exc.code.name, details=exc.message)
