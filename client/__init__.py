"""Python client library for headrace's gRPC API: ``Client`` (synchronous) and ``AsyncClient``
(asyncio) with typed results and exceptions mapped from gRPC statuses.

    from headrace.client import Client
    with Client("localhost:50051", api_token="...") as client:
        print(client.generate("Once upon a time", max_tokens=32).text)
        for chunk in client.stream("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from headrace.client.aio import AsyncClient
from headrace.client.client import Client
from headrace.client.connection import ConnectionOptions
from headrace.client.errors import (Cancelled, DeadlineExceeded, HeadraceError, InvalidRequest,
                                    ModelNotFound, NotReady, PermissionDenied, ServerBusy,
                                    Unauthenticated, Unavailable)
from headrace.client.types import Chunk, Completion, ModelInfo, Tokens, TokenLogprob, Usage

__all__ = ["AsyncClient", "Cancelled", "Chunk", "Client", "Completion", "ConnectionOptions",
           "DeadlineExceeded", "HeadraceError", "InvalidRequest", "ModelInfo", "ModelNotFound", "NotReady",
           "PermissionDenied", "ServerBusy", "Tokens", "TokenLogprob", "Unauthenticated",
           "Unavailable", "Usage"]
