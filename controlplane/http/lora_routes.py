"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}``
and ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}`` (and headrace's optional
``"wait_s"``: how long an unload waits for the adapter's requests, default 30 s). They answer
vLLM's plain-text ``Success: ...`` (200) or an OpenAI error object with vLLM's statuses: 400
for an adapter that cannot be served, a bad body or a name loaded already, 404 for an unknown
name or no adapter at the path, 409 where the server's state is in the way (the adapter's
requests outlast the wait, or the server runs without ``--enable-lora``).

They are operations, so the admin token guards them, as the Admin service's calls
(``headrace.controlplane.admin``): ``Authorization: Bearer <admin token>``, else 401. A server without an
admin token refuses them (403) unless it serves loopback callers without one
(``--admin-insecure-loopback``) and the caller is one.
"""

from __future__ import annotations

import dataclasses
import hmac

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from headrace.controlplane.lora import api as lora_api
from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.protocol import _Body

STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 409,
          grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 400,
          grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
          grpc.StatusCode.UNAVAILABLE: 503}


class LoadBody(_Body):
    lora_name: str
    lora_path: str


class UnloadBody(_Body):
    lora_name: str
    lora_int_id: int | None = None   # vLLM's; names are unique here
    wait_s: float = pydantic.Field(lora_api.DEFAULT_UNLOAD_WAIT_S, ge=0, le=3600)


@dataclasses.dataclass
class AdminAccess:
    """Who may call the routes and what they act on (``lora_api.LoraAdmin``)."""

    admin: lora_api.LoraAdmin
    token: str | None = None
    loopback: bool = False   # no token: loopback callers are served (--admin-insecure-loopback)

    def check(self, request: Request) -> None:
        if self.token:
            scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                  self.token.encode()):
                return
            raise HttpError(401, "runtime LoRA loading needs 'Authorization: Bearer <admin token>'",
                            code="invalid_api_key")
        host = request.client.host if request.client is not None else ""
        if not (self.loopback and host in ("127.0.0.1", "::1", "localhost")):
            raise HttpError(403, "runtime LoRA loading is disabled: the server has no admin token "
                                 "(start it with --admin-token or HEADRACE_ADMIN_TOKEN)")


def _failed(exc: lora_api.AdminError, param: str = "lora_name") -> HttpError:
    status = STATUS.get(exc.code, 500)
    error = HttpError(status, exc.message, param if status in (400, 404, 409) else None)
    if status == 409:
        error.code = "conflict"
    return error


def add(app: FastAPI, api, access: AdminAccess | None) -> None:
    """The two routes on ``app`` (``api``: the app's ``Api``, for its body reader); without
    ``access`` they are not served (404, as vLLM without runtime updating)."""
    if access is None:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        access.check(request)
        body = await api.body(request, LoadBody)
        try:
            await access.admin.load(body.lora_name, body.lora_path)
        except lora_api.AdminError as exc:
            raise _failed(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        access.check(request)
        body = await api.body(request, UnloadBody)
        try:
            await access.admin.unload(body.lora_name, body.wait_s)
        except lora_api.AdminError as exc:
            raise _failed(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
