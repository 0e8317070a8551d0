"""Transport security and credentials shared by both planes: TLS / mutual TLS server and
channel credentials, a bearer-token check for the public API, and the shared secret with
which a data plane accepts only its control plane. Health checks and reflection stay open
(orchestrators probe them); the Admin service has its own token (``controlplane.admin``)."""

from __future__ import annotations

import hmac
import pathlib

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


def bind(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``address`` securely when credentials are given; returns the port (0: failed)."""
    if credentials is not None and not address.startswith("unix:"):
        return server.add_secure_port(address, credentials)
    return server.add_insecure_port(address)


def bearer_metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_ok(value: str | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer TOKEN`` (gRPC metadata, HTTP header)."""
    if not value or not value.startswith("Bearer "):
        return False
    return hmac.compare_digest(value[7:].encode(), token.encode())


def _authorized(metadata, token: str) -> bool:
    for key, value in metadata or ():
        if key == "authorization":
            return bearer_ok(value, token)
    return False


def _denial(handler, message: str, aio: bool):
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    if aio:
        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (makes it an async generator)
    else:
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
    (the Admin service checks its own token)."""

    def __init__(self, token: str, exempt: tuple[str, ...] = ()):
        self.token, self.exempt = token, OPEN_PREFIXES + exempt

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.exempt) or \
                _authorized(details.invocation_metadata, self.token):
            return handler
        return _denial(handler, "missing or wrong bearer token", aio=True)


class SharedSecretInterceptor(grpc.ServerInterceptor):
    """Data plane: only a control plane that knows the shared secret may call it."""

    def __init__(self, secret: str):
        self.secret = secret

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or \
                _authorized(details.invocation_metadata, self.secret):
            return handler
        return _denial(handler, "this data plane serves only its control plane (shared secret)", aio=False)
