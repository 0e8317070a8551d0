"""The client library's exceptions: one class per gRPC status a caller may want to handle
(``HeadraceError`` is the base of all of them), and ``NotReady`` for a server that cannot take
requests, naming its state (down, loading, draining)."""

from __future__ import annotations

import grpc


class HeadraceError(Exception):
    """A call failed; ``code`` is the gRPC status, ``details`` the server's message."""

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details, self.code = details, code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.code is not None else self.details


class InvalidRequest(HeadraceError):
    """INVALID_ARGUMENT: the request is malformed (the message names the field)."""


class Unauthenticated(HeadraceError):
    """UNAUTHENTICATED: no or a wrong API token."""


class PermissionDenied(HeadraceError):
    """PERMISSION_DENIED."""


class ServerBusy(HeadraceError):
    """RESOURCE_EXHAUSTED: the server's queue is full; retry later."""


class Unavailable(HeadraceError):
    """UNAVAILABLE: the server is down, loading, draining or lost its data plane."""


class DeadlineExceeded(HeadraceError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""


class Cancelled(HeadraceError):
    """CANCELLED: the call was cancelled."""


class ModelNotFound(HeadraceError):
    """NOT_FOUND: the request's ``model`` is neither the base model nor a LoRA adapter served."""


class NotReady(Unavailable):
    """The server did not become ready within the connect timeout. ``state`` says why:
    ``down`` (nothing answers at the address), ``loading`` (up, the model is not ready) or
    ``draining`` (up, not admitting requests)."""

    def __init__(self, details: str, state: str):
        super().__init__(details, grpc.StatusCode.UNAVAILABLE)
        self.state = state

    def __str__(self) -> str:
        return self.details


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServerBusy,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
}


def from_rpc_error(exc: grpc.RpcError) -> HeadraceError:
    """The library's exception for a failed gRPC call (sync or asyncio)."""
    code = exc.code()
    return _BY_CODE.get(code, HeadraceError)(exc.details() or code.name, code)
