"""The Admin service of a front end: checks the caller's access here (the same rules as
``headrace.controlplane.admin``: the admin token, else local callers only) and forwards the call to
the engine core's Admin service, which acts on the one engine. Its answer, or its error status, goes
back to the caller unchanged. The call carries the core secret
(``headrace.controlplane.core.security``) beside the caller's ``authorization``.

Under data parallelism (several cores) every call goes to every core at once and the answers
are combined (``combine``): one configuration with the cores' counts summed (running, waiting,
in flight, KV blocks, workers), a drain that is done when every core is, a profile (StartProfile,
StopProfile) with every core's files and errors (each error naming its core), recording while
any core is, its steps summed; the first error status of any core is the answer's."""

from __future__ import annotations

import asyncio

import grpc

from headrace.controlplane.core import security as core_link
from headrace.controlplane.admin import AdminService
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc

METHODS = ("GetConfig", "UpdateConfig", "Drain", "Resume", "ReloadModel", "StartProfile", "StopProfile",
           "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters")
NO_CORE = "the engine core is unavailable (restarting?); retry"
SUMMED = {apb.Config: ("running", "waiting", "in_flight_requests", "num_kv_blocks", "num_host_kv_blocks"),
          apb.DrainResponse: ("in_flight", "aborted"),
          apb.ReloadModelResponse: ("num_kv_blocks", "aborted")}


def combine(answers: list):
    """One answer for several cores' (the first's, with their counts combined)."""
    first = type(answers[0])()
    first.CopyFrom(answers[0])
    for other in answers[1:]:
        for name in SUMMED.get(type(first), ()):
            setattr(first, name, getattr(first, name) + getattr(other, name))
        if isinstance(first, apb.Config):
            first.workers.extend(other.workers)
            first.ready = first.ready or other.ready
            first.draining = first.draining and other.draining
            first.max_model_len = min(first.max_model_len, other.max_model_len)
        elif isinstance(first, apb.DrainResponse):
            first.drained = first.drained and other.drained
        elif isinstance(first, apb.ReloadModelResponse):
            first.max_model_len = min(first.max_model_len, other.max_model_len)
            first.seconds = max(first.seconds, other.seconds)
    if isinstance(first, apb.LoraAdapters) and len(answers) > 1:   # each core's sequences summed
        by_name = {s.adapter.name: s for s in first.adapters}
        for other in answers[1:]:
            for state in other.adapters:
                mine = by_name.get(state.adapter.name)
                if mine is not None:
                    mine.running += state.running
                    mine.waiting += state.waiting
                    mine.in_slot, mine.cached = mine.in_slot and state.in_slot, mine.cached and state.cached
    if isinstance(first, apb.ProfileStatus) and len(answers) > 1:
        first.recording = any(a.recording for a in answers)
        first.steps_recorded = sum(a.steps_recorded for a in answers)
        del first.files[:], first.errors[:]
        for i, answer in enumerate(answers):
            first.files.extend(answer.files)
            first.errors.extend(f"core {i}: {error}" for error in answer.errors)
    return first


class AdminProxy(AdminService):
    def __init__(self, channels, token: str | None = None, enabled: bool = True,
                 secret: str | None = None):
        """``channels``: one engine core's channel, or every data-parallel core's."""
        super().__init__(plane=None, token=token, enabled=enabled)
        channels = channels if isinstance(channels, (list, tuple)) else [channels]
        self.stubs = [apb_grpc.AdminStub(channel) for channel in channels]
        self.secret_metadata = list(core_link.metadata(secret))

    async def _forward(self, method: str, request, context):
        await self._authorize(context)
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        metadata += self.secret_metadata
        answers = await asyncio.gather(*(getattr(stub, method)(request, metadata=metadata)
                                         for stub in self.stubs), return_exceptions=True)
        for exc in answers:
            if isinstance(exc, grpc.aio.AioRpcError):
                code = exc.code()
                details = NO_CORE if code == grpc.StatusCode.UNAVAILABLE and not exc.details() else exc.details()
                await context.abort(code, details)
            if isinstance(exc, BaseException):
                raise exc
        return combine(answers)


def _forwarding(method: str):
    async def call(self, request, context):
        return await self._forward(method, request, context)

    call.__name__ = method
    return call


for _name in METHODS:
    setattr(AdminProxy, _name, _forwarding(_name))
