"""The transport-neutral request path every public API shares (gRPC ``Inference`` and the
OpenAI-compatible HTTP API): readiness, queue limit, sampling defaults, chat rendering,
validation, duplicate ids, tracing, per-API metrics, submission, streaming and abort-on-exit.

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
from controlplane.chat_template import ChatTemplate, ChatTemplateError
from controlplane.engine import Engine
from common.logs import get_logger
from controlplane.sampling_defaults import SamplingDefaults
from controlplane.tokenizer import ModelTokenizer
from controlplane.validation import MAX_PROMPT_CHARS, ValidationError, build_request, check_text
from headrace.v1 import inference_pb2 as pb

log = get_logger("headrace.request")
MAX_MESSAGES = 4096


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


class RequestPath:
    """What the front ends call. ``set_model`` swaps tokenizer, chat template and sampling
    defaults together (start-up, Admin reload)."""

    def __init__(self, engine: Engine, model_dir: str, tokenizer: ModelTokenizer, *,
                 chat_template: str | None = None, generation_config: str = "auto",
                 log_prompts: bool = False):
        self.engine = engine
        self.log_prompts = log_prompts
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

    # -- input -----------------------------------------------------------------------------
    def render_chat(self, chat: pb.ChatMessages) -> list[int]:
        """The prompt ids of a conversation: rendered with the chat template and tokenized
        without adding special tokens (the template writes them)."""
        if self.chat_template is None:
            raise ValidationError("messages: the model has no chat template (no chat_template in "
                                  "tokenizer_config.json, no chat_template.jinja); start the server "
                                  "with --chat-template FILE or send a prompt")
        if not chat.messages:
            raise ValidationError("messages must not be empty")
        if len(chat.messages) > MAX_MESSAGES:
            raise ValidationError(f"messages: at most {MAX_MESSAGES} messages")
        size = sum(len(m.content) + len(m.extra_json) for m in chat.messages) + len(chat.tools_json) \
            + len(chat.documents_json) + len(chat.template_kwargs_json)
        if size > MAX_PROMPT_CHARS:
            raise ValidationError(f"messages are longer than {MAX_PROMPT_CHARS} characters")
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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            check_text("text", text)
        except ValidationError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- generation ------------------------------------------------------------------------
    async def generate(self, request: pb.GenerateRequest, *, api: str = "grpc",
                       method: str = "Generate", metadata: Iterable[tuple[str, str]] = (),
                       span_name: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the request's responses. ``api``/``method`` label the metrics; ``metadata``:
        the caller's headers (``traceparent``); ``span_name``: open a server span (front ends
        without tracing instrumentation)."""
        self.engine.telemetry.metrics.api_request(api, method)
        tracer = self.tracer if span_name else None
        with contextlib.ExitStack() as stack:
            if tracer is not None:
                stack.enter_context(tracer.start_as_current_span(
                    span_name, context=tracing.extract(dict(metadata)), kind=trace.SpanKind.SERVER,
                    record_exception=False, set_status_on_exception=False))
            structlog.contextvars.bind_contextvars(request_id=request.request_id,
                                                   trace_id=tracing.request_trace_id(metadata))
            try:
                req = self._admit(request)
            except RequestError as exc:
                self._failed(api, method, exc)
                raise
            try:
                while not req.delivered:
                    responses = await req.next_responses()
                    if req.failure is not None:
                        raise RequestError(req.failure.code, req.failure.message)
                    for msg in responses:
                        yield msg
            except RequestError as exc:
                self._failed(api, method, exc)
                raise
            finally:
                self.engine.abort(req)   # no-op when finished; frees the blocks when the client left

    def _admit(self, request: pb.GenerateRequest):
        engine = self.engine
        self.check_ready()
        if engine.config.max_queued and len(engine.scheduler.waiting) >= engine.config.max_queued:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue is full ({engine.config.max_queued} waiting); retry later")
        try:
            req = build_request(self.defaults.apply(request), self.tokenizer, seq_ids=engine.seq_ids,
                                vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                                eos_token_ids=list(engine.info.eos_token_ids),
                                render_chat=self.render_chat,
                                default_max_tokens=self.defaults.max_tokens)
        except ValidationError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if req.request_id in engine.requests:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id {req.request_id!r} is already in use")
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        if self.log_prompts:
            log.info("request received", prompt=request.prompt or None,
                     prompt_token_ids=list(req.sequences[0].prompt_token_ids))
        engine.submit(req)
        return req

    def _failed(self, api: str, method: str, exc: RequestError) -> None:
        self.engine.telemetry.metrics.rpc_error(method, exc.code, api)
        tracing.mark_span_failed(exc.code)
        log.info("request failed", code=exc.code.name, details=exc.message)
