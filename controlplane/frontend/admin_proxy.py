"""The Admin service of a front end: checks the caller's access here (the same rules as
``controlplane.admin``: the admin token, else local callers only) and forwards the call to the
engine core's Admin service, which acts on the one engine. Its answer, or its error status,
goes back to the caller unchanged. The call carries the core secret (``controlplane.core_link``)
beside the caller's ``authorization``."""

from __future__ import annotations

import grpc

from controlplane import core_link
from controlplane.admin import AdminService
from headrace.v1 import admin_pb2_grpc as apb_grpc

METHODS = ("GetConfig", "UpdateConfig", "Drain", "Resume", "ReloadModel", "StartProfile", "StopProfile")
NO_CORE = "the engine core is unavailable (restarting?); retry"


class AdminProxy(AdminService):
    def __init__(self, channel: grpc.aio.Channel, token: str | None = None, enabled: bool = True,
                 secret: str | None = None):
        super().__init__(plane=None, token=token, enabled=enabled)
        self.stub = apb_grpc.AdminStub(channel)
        self.secret_metadata = list(core_link.metadata(secret))

    async def _forward(self, method: str, request, context):
        await self._authorize(context)
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        metadata += self.secret_metadata
        try:
            return await getattr(self.stub, method)(request, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            details = NO_CORE if code == grpc.StatusCode.UNAVAILABLE and not exc.details() else exc.details()
            await context.abort(code, details)


def _forwarding(method: str):
    async def call(self, request, context):
        return await self._forward(method, request, context)

    call.__name__ = method
    return call


for _name in METHODS:
    setattr(AdminProxy, _name, _forwarding(_name))
