"""Transport security and credentials shared by both planes: TLS / mutual TLS server and
channel credentials, a bearer-token check for the public API, and the shared secret with
which a data plane accepts only its control plane (and an engine core only its API front ends,
``AioSecretInterceptor``). Health checks and reflection stay open
(orchestrators probe them); the Admin service has its own token (``headrace.controlplane.admin``).

The public API may have several tokens, each naming a tenant (``ApiTokens``): the scheduler
shares the server fairly between tenants. A refused call is answered without reading its
request message (a denial handler that streams requests never asks for one), so callers
without a token cost no more memory than the transport's flow-control window."""

from __future__ import annotations

import hmac
import os
import pathlib
import re

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def server_credentials(cert: str | None, key: str | None,
                       client_ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS with ``cert``/``key``; with ``client_ca`` also mutual TLS (client certificates
    signed by that CA are required). None when no certificate is given (plaintext)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and its key")
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca: str | None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials | None:
    """Client side: verify the server against ``ca``; present ``cert``/``key`` for mutual TLS."""
    if not (ca or cert or key):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def worker_secret(given: str | None = None, environ=os.environ) -> str | None:
    """The planes' shared secret: ``given`` (a flag), else ``$HEADRACE_WORKER_SECRET``, else the
    contents of the file ``$HEADRACE_WORKER_SECRET_FILE`` names (``headrace.common.secret_env``,
    where every secret is read)."""
    from headrace.common import secret_env

    return secret_env.worker_secret(given, environ)


def bind(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``address`` securely when credentials are given; returns the port (0: failed)."""
    if credentials is not None and not address.startswith("unix:"):
        return server.add_secure_port(address, credentials)
    return server.add_insecure_port(address)


DEFAULT_TENANT = "default"
_TENANT = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ApiTokens:
    """Bearer tokens of the public API, each naming a tenant. An entry is ``TOKEN`` (tenant
    ``default``) or ``TENANT=TOKEN`` (TENANT: letters, digits, ``_.:-``, at most 64; a token
    that itself contains ``=`` must be given with its tenant)."""

    def __init__(self, entries=()):
        self.entries: list[tuple[bytes, str]] = []
        for entry in entries:
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            tenant, sep, token = entry.partition("=")
            if not sep or not _TENANT.fullmatch(tenant) or not token or token.startswith("="):
                tenant, token = DEFAULT_TENANT, entry
            self.entries.append((token.encode(), tenant))

    @classmethod
    def load(cls, tokens=(), file: str | None = None, environ=os.environ) -> "ApiTokens":
        """From ``--api-token`` values, ``--api-tokens-file`` (one entry a line) and, when
        neither is given, $HEADRACE_API_TOKENS (comma-separated) and $HEADRACE_API_TOKEN
        (``headrace.common.secret_env``)."""
        from headrace.common.secret_env import api_token_entries

        return cls(api_token_entries(tokens, file, environ))

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self.entries}

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``authorization`` value (``Bearer TOKEN``), None if no token
        matches (every token is compared, in constant time each)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given, found = authorization[7:].encode(), None
        for token, tenant in self.entries:
            if hmac.compare_digest(given, token) and found is None:
                found = tenant
        return found


def as_tokens(tokens) -> ApiTokens:
    """``ApiTokens`` from an ``ApiTokens``, a single token string, a list of entries or None."""
    if isinstance(tokens, ApiTokens):
        return tokens
    return ApiTokens([tokens] if isinstance(tokens, str) else (tokens or ()))


def bearer_metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_ok(value: str | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer TOKEN`` (gRPC metadata, HTTP header)."""
    if not value or not value.startswith("Bearer "):
        return False
    return hmac.compare_digest(value[7:].encode(), token.encode())


def _authorized(metadata, tokens: ApiTokens) -> bool:
    for key, value in metadata or ():
        if key == "authorization":
            return tokens.tenant(value) is not None
    return False


def _denial(handler, message: str, aio: bool):
    """A handler answering UNAUTHENTICATED. In the aio server it takes a request stream for
    every method (the wire is the same) so the request message is never read: an unary one
    would first receive the whole message, up to the receive limit, into memory."""
    if aio:
        async def deny_unary(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (makes it an async generator)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.stream_unary_rpc_method_handler(deny_unary)

    def deny_unary(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary)
    return grpc.stream_stream_rpc_method_handler(deny_stream)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Public API: every call but health and reflection needs ``authorization: Bearer TOKEN``
    with one of the tokens (the Admin service checks its own token)."""

    def __init__(self, tokens, exempt: tuple[str, ...] = ()):
        self.tokens, self.exempt = as_tokens(tokens), OPEN_PREFIXES + exempt

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.exempt) or \
                _authorized(details.invocation_metadata, self.tokens):
            return handler
        return _denial(handler, "missing or wrong bearer token", aio=True)


class SharedSecretInterceptor(grpc.ServerInterceptor):
    """Data plane: only a control plane that knows the shared secret may call it."""

    def __init__(self, secret: str):
        self.secret = ApiTokens([f"{DEFAULT_TENANT}={secret}"])

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or \
                _authorized(details.invocation_metadata, self.secret):
            return handler
        return _denial(handler, "this data plane serves only its control plane (shared secret)", aio=False)


class AioSecretInterceptor(grpc.aio.ServerInterceptor):
    """An aio server that serves only callers presenting ``secret`` in metadata ``key`` (health
    and reflection stay open); others are refused UNAUTHENTICATED with ``message``."""

    def __init__(self, secret: str, key: str, message: str):
        self.secret, self.key, self.message = secret.encode(), key, message

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        for key, value in details.invocation_metadata or ():
            if key == self.key and hmac.compare_digest(value.encode(), self.secret):
                return handler
        return _denial(handler, self.message, aio=True)
