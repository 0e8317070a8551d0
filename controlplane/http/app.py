"""The OpenAI-compatible routes (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/health, /ready, /tokenize, /detokenize. The ``--api-token`` (any of them) is checked as ``Authorization:
Bearer`` before a body is read; bodies are read with a size bound (the largest valid request,
``controlplane.limits``) and validated with the ``protocol`` models; every error
is an OpenAI error object (never a stack trace); generation goes through the request path with
the caller's headers (``traceparent``) and ``api="http"`` in the metrics."""

from __future__ import annotations

import logging
import time

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from controlplane.http import convert, responses, streaming, structured
from controlplane.http.convert import HttpError
from controlplane.http.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest, error_body)
from controlplane.request_path import RequestError, RequestPath
from common.security import as_tokens

log = logging.getLogger("headrace.http")
MAX_BODY_BYTES = 32 << 20
WHOLE = 1 << 30   # stream_interval of non-streaming requests (more than any max_tokens)


class Api:
    def __init__(self, path: RequestPath, api_token, max_body: int = MAX_BODY_BYTES):
        self.path, self.token, self.max_body = path, as_tokens(api_token), max_body
        self.metrics = path.engine.telemetry.metrics
        self._texts: dict[int, str] = {}
        self._texts_of = None

    # -- helpers ---------------------------------------------------------------------------
    def token_text(self, tid: int) -> str:
        if self._texts_of is not self.path.tokenizer:   # a reload brings a new vocabulary
            self._texts, self._texts_of = {}, self.path.tokenizer
        text = self._texts.get(tid)
        if text is None:
            text = self._texts[tid] = self.path.tokenizer.decode([tid])
        return text

    def check_auth(self, request: Request) -> None:
        if self.token and self.token.tenant(request.headers.get("authorization")) is None:
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                            code="invalid_api_key")

    def model_names(self) -> set[str]:
        info = self.path.engine.info
        return {self.path.model_name, self.path.model_dir} | ({info.model_name} if info else set())

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names():
            raise HttpError(404, f"the model {model!r} does not exist; this server serves "
                                 f"{self.path.model_name!r}", "model", "model_not_found")

    async def body(self, request: Request, model: type[pydantic.BaseModel]):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            raise HttpError(413, f"request body is larger than {self.max_body} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise HttpError(413, f"request body is larger than {self.max_body} bytes")
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks))
        except pydantic.ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = [str(p) for p in err["loc"]]
            param = loc[0] if loc else None
            raise HttpError(400, f"{'.'.join(loc) or 'body'}: {err['msg']}", param) from None

    def failed(self, method: str):
        def on_error(exc: HttpError) -> None:
            if not getattr(exc, "counted", False):
                self.metrics.rpc_error(method, exc.grpc_code, "http")
        return on_error

    def gone(self, method: str):
        return lambda: self.metrics.rpc_error(method, grpc.StatusCode.CANCELLED, "http")

    def streams(self, request: Request, reqs, route: str, method: str):
        meta = list(request.headers.items())
        return [self.path.generate(r, api="http", method=method, metadata=meta,
                                   span_name=f"POST {route}") for r in reqs]

    # -- generation ------------------------------------------------------------------------
    async def generate(self, request: Request, chat: bool):
        route, method = ("/v1/chat/completions", "ChatCompletions") if chat else \
            ("/v1/completions", "Completions")
        on_error = self.failed(method)
        try:
            self.check_auth(request)
            body = await self.body(request, ChatCompletionRequest if chat else CompletionRequest)
            self.check_model(body.model)
            try:
                reqs = [convert.chat_request(body)] if chat else convert.completion_requests(body)
            except ValueError as exc:   # a value no field can hold (the known ones are bounded)
                raise HttpError(400, f"invalid request: {exc}") from None
            try:   # n x prompts against --max-n and the queue, before any prompt is tokenized
                self.path.check_batch(len(reqs), body.n)
            except RequestError as exc:
                error = HttpError.from_request_error(exc, chat)
                error.counted = False   # (refused here, not in the request path)
                raise error from None
        except HttpError as exc:
            on_error(exc)
            return JSONResponse(exc.body(), exc.status)
        top_n = (body.top_logprobs or 0 if body.logprobs else None) if chat else body.logprobs
        fmt = streaming.Formatter(chat, body.model or self.path.model_name, body.n, top_n, self.token_text,
                                  tools=structured.tool_mode(body) if chat else None)
        if not body.stream:   # one message per sample at its end: no per-token wake-ups
            for r in reqs:
                r.stream_interval = WHOLE
        streams = self.streams(request, reqs, route, method)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return responses.event_stream(streaming.sse_chunks(fmt, streams, usage, chat),
                                          self.gone(method), on_error)
        return responses.json_result(lambda: streaming.whole(fmt, streams, chat), self.gone(method),
                                     on_error)


def build_app(path: RequestPath, api_token=None, tensor_parallel_size: int = 1,
              max_body: int = MAX_BODY_BYTES) -> FastAPI:
    api = Api(path, api_token, max_body)
    app = FastAPI(title="headrace", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    @app.exception_handler(HttpError)
    async def _http_error(request, exc: HttpError):
        api.failed(request.url.path)(exc)
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestError)
    async def _request_error(request, exc: RequestError):
        return await _http_error(request, HttpError.from_request_error(exc))

    @app.exception_handler(HTTPException)
    async def _starlette(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), 500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.generate(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_auth(request)
        path.check_loaded()
        card = {"id": path.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "headrace", "root": path.model_dir, "parent": None,
                "max_model_len": path.engine.max_model_len,
                "deterministic": bool(path.engine.info.deterministic)}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        path.check_loaded()   # liveness: the model is loaded and the data plane answers
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        path.check_ready()    # readiness: also admitting requests (not draining)
        return {"status": "ready", "tensor_parallel_size": tensor_parallel_size}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        api.check_auth(request)
        body = await api.body(request, TokenizeRequest)
        api.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HttpError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            try:
                ids = await path.chat_ids(convert.chat_messages(
                    body.messages, add_generation_prompt=body.add_generation_prompt))
            except ValueError as exc:   # ValidationError
                raise HttpError(400, str(exc), "messages") from None
        else:
            ids = await path.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": path.engine.max_model_len, "tokens": ids,
                "token_strs": path.tokenizer.tokens(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        api.check_auth(request)
        body = await api.body(request, DetokenizeRequest)
        api.check_model(body.model)
        vocab = path.tokenizer.tokenizer.get_vocab_size()
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HttpError(400, f"tokens: token id {bad} is out of vocabulary (size {vocab})", "tokens")
        return {"prompt": path.tokenizer.decode(body.tokens)}

    return app
