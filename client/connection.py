"""How the client library reaches a server: connection options (explicit, else ``HEADRACE_*``
environment variables, else defaults), the gRPC channel they make (plaintext, TLS or mutual
TLS; bearer token metadata), and the server's state as a client sees it: ``serving``,
``loading`` (up, health NOT_SERVING, not draining), ``draining`` or ``down`` (nothing answers).

Environment: ``HEADRACE_ADDRESS``, ``HEADRACE_API_TOKEN``, ``HEADRACE_TLS_CA`` (verify the
server with this CA; TLS), ``HEADRACE_TLS_CERT``/``HEADRACE_TLS_KEY`` (client certificate for
mutual TLS), ``HEADRACE_CONNECT_TIMEOUT`` (seconds), ``HEADRACE_SESSION_ID``.

``session_id`` goes out as the ``x-session-id`` header (``SESSION_HEADER``) of every call, or
of one call (``session_id=`` of ``generate``/``stream``): a load balancer in front of several
servers keeps the calls of one session on one server, where its prefix is cached (the Envoy
configuration in deploy/envoy hashes it; docs/scaling.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.v1 import admin_pb2, admin_pb2_grpc
from headrace.v1 import inference_pb2, inference_pb2_grpc
from headrace.client.errors import NotReady, from_rpc_error

DEFAULT_ADDRESS = "localhost:50051"
DEFAULT_CONNECT_TIMEOUT = 5.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
SERVING, LOADING, DRAINING, DOWN = "serving", "loading", "draining", "down"
SESSION_HEADER = "x-session-id"


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


@dataclasses.dataclass(frozen=True)
class ConnectionOptions:
    address: str = DEFAULT_ADDRESS
    api_token: str | None = None
    tls: bool = False                   # TLS with the system's roots when no tls_ca is given
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    session_id: str | None = None       # affinity key for a load balancer (``SESSION_HEADER``)

    @classmethod
    def resolve(cls, address: str | None = None, *, api_token: str | None = None,
                tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None, connect_timeout: float | None = None,
                session_id: str | None = None) -> "ConnectionOptions":
        """Explicit values first, then the HEADRACE_* environment, then the defaults."""
        timeout = connect_timeout if connect_timeout is not None else _env("HEADRACE_CONNECT_TIMEOUT")
        opts = cls(address=address or _env("HEADRACE_ADDRESS") or DEFAULT_ADDRESS,
                   api_token=api_token or _env("HEADRACE_API_TOKEN"), tls=tls,
                   tls_ca=tls_ca or _env("HEADRACE_TLS_CA"),
                   tls_cert=tls_cert or _env("HEADRACE_TLS_CERT"),
                   tls_key=tls_key or _env("HEADRACE_TLS_KEY"),
                   connect_timeout=float(timeout) if timeout is not None else DEFAULT_CONNECT_TIMEOUT,
                   session_id=session_id or _env("HEADRACE_SESSION_ID"))
        if bool(opts.tls_cert) != bool(opts.tls_key):
            raise ValueError("a client certificate (tls_cert) needs its key (tls_key), and the other way round")
        for path in (opts.tls_ca, opts.tls_cert, opts.tls_key):
            if path and not pathlib.Path(path).is_file():
                raise ValueError(f"no such file: {path}")
        return opts

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.secure:
            return None
        read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    @property
    def metadata(self) -> tuple:
        return self.call_metadata()

    def call_metadata(self, session_id: str | None = None) -> tuple:
        """A call's metadata: the bearer token, the session key (this call's, else the
        client's)."""
        out = (("authorization", f"Bearer {self.api_token}"),) if self.api_token else ()
        session = session_id or self.session_id
        return out + (((SESSION_HEADER, session),) if session else ())

    def channel(self) -> grpc.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(self.address, creds, options=CHANNEL_OPTIONS)

    def aio_channel(self) -> grpc.aio.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(self.address, creds, options=CHANNEL_OPTIONS)


def probe(channel: grpc.Channel, opts: ConnectionOptions, timeout: float = 2.0) -> tuple[str, str]:
    """(state, detail) of the server behind ``channel``. Health says serving or not; a server
    that is up but not serving is draining when its Admin service says so (local callers) or
    when it still answers GetModelInfo (it does while draining, not while loading)."""
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
    except grpc.RpcError as exc:
        return DOWN, exc.details() or exc.code().name
    if status == health_pb2.HealthCheckResponse.SERVING:
        return SERVING, ""
    with contextlib.suppress(grpc.RpcError):
        config = admin_pb2_grpc.AdminStub(channel).GetConfig(admin_pb2.GetConfigRequest(),
                                                             timeout=timeout)
        return (DRAINING, "") if config.draining else (LOADING, "")
    try:
        inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), metadata=opts.metadata, timeout=timeout)
    except grpc.RpcError:
        return LOADING, ""
    return DRAINING, ""


def not_ready(opts: ConnectionOptions, state: str, detail: str, waited: float) -> NotReady:
    where = f"headrace server at {opts.address}"
    if state == DOWN:
        return NotReady(f"{where} is down: nothing answered within {waited:.0f}s ({detail})", DOWN)
    if state == DRAINING:
        return NotReady(f"{where} is draining: it admits no new requests "
                        f"('headrace admin resume' admits them again)", DRAINING)
    return NotReady(f"{where} is up but still loading the model after {waited:.0f}s "
                    f"(or its data plane is restarting)", LOADING)


def wait_ready(channel: grpc.Channel, opts: ConnectionOptions, timeout: float | None = None) -> None:
    """Returns once the server is SERVING; NotReady naming its state after ``timeout``
    (default: the connect timeout)."""
    timeout = opts.connect_timeout if timeout is None else timeout
    start = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - start)
        state, detail = probe(channel, opts, timeout=max(0.2, min(2.0, left)))
        if state == SERVING:
            return
        if time.monotonic() - start + 0.25 >= timeout:
            raise not_ready(opts, state, detail, timeout)
        time.sleep(0.25)


@contextlib.contextmanager
def mapped_errors():
    """gRPC failures (sync or asyncio) raised as the library's exceptions."""
    try:
        yield
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
