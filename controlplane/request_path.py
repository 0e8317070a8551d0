"""The transport-neutral request path every public API shares (gRPC ``Inference`` and the
OpenAI-compatible HTTP API): readiness, queue limit, sampling defaults, chat rendering,
validation, duplicate ids, tracing, per-API metrics, submission, streaming and abort-on-exit;
the per-request admission bounds (``controlplane.limits``: text size, ``n``, queue) and the
client's tenant (its API token, or a trusted ``x-headrace-tenant`` header); the client-facing
TTFT, ITL and e2e latency of each stream (``controlplane.stream_latency``).

Tokenization and chat rendering of long texts run off the event loop
(``controlplane.tokenizer.off_loop``), after every cheap check passed, so one client's prompt
never delays another's tokens. Every stream that ends before its last response (client cancel,
deadline, disconnect, server abort) is logged and counted with its reason.

``generate`` yields ``GenerateResponse`` messages and raises ``RequestError`` (a gRPC status code
and a message) for every refusal; each transport maps it to its own status. A consumer that stops
iterating (client gone) closes the generator, which aborts the request and frees its blocks.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import AsyncIterator, Iterable

import grpc
import structlog
from opentelemetry import trace

from common import tracing
from common.logs import get_logger
from common.security import DEFAULT_TENANT, ApiTokens
from controlplane import limits
from controlplane.chat_template import ChatTemplate, ChatTemplateError
from controlplane.engine import Engine
from controlplane.sampling_defaults import SamplingDefaults
from controlplane.stream_latency import StreamLatency
from controlplane.tokenizer import INLINE_CHARS, ModelTokenizer, off_loop
from controlplane.validation import ValidationError, build_request, check_request, check_text
from headrace.v1 import inference_pb2 as pb

log = get_logger("headrace.request")
MAX_MESSAGES = 4096
TENANT_HEADER = "x-headrace-tenant"


class RequestError(Exception):
    """A request refused or ended by the server: ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _json(field: str, text: str, kind: type):
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"messages.{field} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise ValidationError(f"messages.{field} must be a JSON {kind.__name__}")
    return value


def _aborted(req) -> bool:
    return any(s.finish_reason == pb.FINISH_REASON_ABORTED for s in req.sequences)


def queue_full(bound: int, waiting: int) -> str | None:
    """The refusal when ``waiting`` sequences already fill the queue bound (0: unbounded)."""
    if bound and waiting >= bound:
        return (f"queue is full ({bound} waiting sequences at most, the server's --max-queued); "
                "retry later")
    return None


class RequestPath:
    """What the front ends call. ``set_model`` swaps tokenizer, chat template and sampling
    defaults together (start-up, Admin reload)."""

    def __init__(self, engine: Engine, model_dir: str, tokenizer: ModelTokenizer, *,
                 chat_template: str | None = None, generation_config: str = "auto",
                 log_prompts: bool = False, tokens: ApiTokens | None = None,
                 trust_tenant_header: bool = False, max_n: int = limits.DEFAULT_MAX_N):
        self.engine = engine
        self.log_prompts = log_prompts
        self.tokens, self.trust_tenant_header = tokens or ApiTokens(), trust_tenant_header
        self.max_n = max_n
        self.chat_template_file = chat_template
        self.generation_config = generation_config
        self.tracer = tracing.get_tracer("headrace.controlplane")   # None: tracing off
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
        if self.engine.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        if not self.engine.healthy or self.engine.scheduler is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)")

    def check_loaded(self) -> None:
        """The model is there (answers while draining): model info, tokenization."""
        if not self.engine.healthy or self.engine.info is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "model is not ready (loading or data plane down)")

    @property
    def max_text_bytes(self) -> int:
        """The longest text worth tokenizing for the served model (``controlplane.limits``)."""
        return limits.max_text_bytes(self.engine.max_model_len, self.tokenizer.max_token_bytes)

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
        if self.chat_template is None:
            raise ValidationError("messages: the model has no chat template (no chat_template in "
                                  "tokenizer_config.json, no chat_template.jinja); start the server "
                                  "with --chat-template FILE or send a prompt")
        if not chat.messages:
            raise ValidationError("messages must not be empty")
        if len(chat.messages) > MAX_MESSAGES:
            raise ValidationError(f"messages: at most {MAX_MESSAGES} messages")
        size = sum(len(m.content) + len(m.extra_json) + len(m.role) + len(m.name)
                   for m in chat.messages) + len(chat.tools_json) \
            + len(chat.documents_json) + len(chat.template_kwargs_json)
        if size > self.max_text_bytes:
            raise ValidationError(f"messages are longer than any prompt the model can take: at "
                                  f"most {self.max_text_bytes} characters in all")
        return size

    def render_chat(self, chat: pb.ChatMessages) -> list[int]:
        """The prompt ids of a conversation: rendered with the chat template and tokenized
        without adding special tokens (the template writes them)."""
        self.check_chat(chat)
        messages = []
        for i, m in enumerate(chat.messages):
            if not m.role:
                raise ValidationError(f"messages[{i}].role must not be empty")
            message = _json(f"messages[{i}].extra_json", m.extra_json, dict) or {}
            message.update(role=m.role, content=m.content)
            if m.HasField("name"):
                message["name"] = m.name
            messages.append(message)
        kwargs = _json("template_kwargs_json", chat.template_kwargs_json, dict) or {}
        for reserved in ("messages", "tools", "documents", "add_generation_prompt",
                         "continue_final_message"):
            kwargs.pop(reserved, None)
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else \
            not chat.continue_final_message
        try:
            text = self.chat_template.render(
                messages, add_generation_prompt=add_gen,
                continue_final_message=chat.continue_final_message,
                tools=_json("tools_json", chat.tools_json, list),
                documents=_json("documents_json", chat.documents_json, list), **kwargs)
        except ChatTemplateError as exc:
            raise ValidationError(f"messages: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def chat_ids(self, chat: pb.ChatMessages) -> list[int]:
        """``render_chat`` off the event loop when the conversation is long (ValidationError)."""
        if self.check_chat(chat) <= INLINE_CHARS:
            return self.render_chat(chat)
        return await off_loop(self.render_chat, chat)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The Tokenize RPC and HTTP /tokenize: bounded like a prompt, encoded off the loop."""
        try:
            check_text("text", text, self.max_text_bytes)
        except ValidationError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return await self.tokenizer.encode_async(text, add_special_tokens)

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        kind = request.WhichOneof("input")
        if kind == "messages":
            return await self.chat_ids(request.messages)
        if kind == "prompt":
            return await self.tokenizer.encode_async(request.prompt)
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
            try:
                while not req.delivered:
                    responses = await req.next_responses()
                    if req.failure is not None:
                        raise RequestError(req.failure.code, req.failure.message)
                    now = latency.handing(responses)
                    if req.delivered and not _aborted(req):
                        latency.finished(now)
                    for msg in responses:
                        yield msg
            except RequestError as exc:
                # a refusal after submission (a grammar that does not compile) abandons nothing
                reason = "refused" if exc.code == grpc.StatusCode.INVALID_ARGUMENT else "server_abort"
                self._failed(api, method, exc)
                raise
            finally:
                if reason is None and not req.delivered:
                    reason = gone_reason()
                elif reason is None and _aborted(req):
                    reason = "server_abort"   # drained or reloaded: a last ABORTED response
                if reason not in (None, "refused"):
                    self._abandoned(req, api, reason)
                self.engine.abort(req)   # no-op when finished; frees the blocks when the client left

    def _check_queue(self) -> None:
        problem = queue_full(self.engine.max_queued, len(self.engine.scheduler.waiting))
        if problem:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)

    async def _admit(self, request: pb.GenerateRequest, tenant: str):
        engine = self.engine
        self.check_ready()
        self._check_queue()
        request = self.defaults.apply(request)
        try:   # every cheap check first: refused requests cost no tokenization
            check_request(request, vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                          max_n=self.max_n, max_text_bytes=self.max_text_bytes)
            ids = await self._prompt_ids(request)
            self.check_ready()   # a drain or reload may have begun meanwhile
            self._check_queue()
            req = build_request(request, self.tokenizer, seq_ids=engine.seq_ids, ids=ids,
                                vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                                eos_token_ids=list(engine.info.eos_token_ids), max_n=self.max_n,
                                default_max_tokens=self.defaults.max_tokens, tenant=tenant,
                                checked=True)
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
        return req

    def _abandoned(self, req, api: str, reason: str) -> None:
        self.engine.telemetry.metrics.abandoned(reason)
        log.info("request abandoned", reason=reason, api=api, tenant=req.tenant,
                 completion_tokens=sum(len(s.output_token_ids) for s in req.sequences))

    def _failed(self, api: str, method: str, exc: RequestError) -> None:
        self.engine.telemetry.metrics.rpc_error(method, exc.code, api)
        tracing.mark_span_failed(exc.code)
        log.info("request failed", code=exc.code.name, details=exc.message)
