"""The HTTP API's errors: ``HttpError`` (an HTTP status, an OpenAI error object and the gRPC
status a refusal maps back to), and the mapping of the request path's errors (gRPC status
codes and their messages) to HTTP statuses and the ``param`` OpenAI's clients read."""

from __future__ import annotations

import re

import grpc

from headrace.controlplane.http.protocol import error_body

STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
          grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 409: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
GRPC_CODE = {v: k for k, v in STATUS.items()} | {413: grpc.StatusCode.INVALID_ARGUMENT}
_PARAM = re.compile(r"^(?:sampling\.)?([a-z_]+)")
# headrace.controlplane.requests.validation.check_fits: a prompt that fits alone but not with its max_tokens;
# max_tokens is the parameter to change (OpenAI's clients read ``param`` so)
_TOO_LONG = re.compile(r"^prompt \d+ tokens \+ max_tokens \d+ > max_model_len")
STRUCTURED_PARAM = "response_format"   # the request path's "structured: ..." refusals


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_request_error(cls, exc, chat: bool = False) -> "HttpError":
        status = STATUS.get(exc.code, 500)
        param = None
        if status == 400 and _TOO_LONG.match(exc.message):
            param = "max_tokens"
        elif status == 400 and (m := _PARAM.match(exc.message)):
            param = m.group(1)
            if param in ("prompt", "prompt_token_ids"):
                param = "messages" if chat else "prompt"
            elif param == "structured":
                param = STRUCTURED_PARAM
        error = cls(status, exc.message, param)
        error.counted = True   # the request path counted it
        return error

    def body(self) -> dict:
        return error_body(self.message, TYPES.get(self.status, "server_error"), self.param, self.code)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE.get(self.status, grpc.StatusCode.INTERNAL)
