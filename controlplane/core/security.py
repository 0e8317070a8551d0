"""The security of the link between the API front ends and the engine core (issue 18).

- A unix socket (``headrace serve``'s default, in its private 0700 directory) is for this
  machine's user only: the core creates it 0600 wherever it is.
- A TCP address may carry TLS: the core serves it with ``--core-tls-cert``/``--core-tls-key``
  and the front ends verify it against ``--core-ca``. A TCP address beyond loopback without
  TLS is refused (the front ends' secret, and every prompt, would cross the network in the
  clear).
- The core accepts only front ends presenting its shared secret (``--core-secret``, or
  $HEADRACE_CORE_SECRET; ``headrace serve`` makes a fresh one), in the ``x-headrace-core-secret``
  metadata of every call but health (Admin calls keep their caller's ``authorization``). A TCP
  address beyond loopback without a secret is refused too.
"""

from __future__ import annotations

import contextlib
import os

import grpc

from headrace.common import net, security
from headrace.common.grpc_options import CORE_MAX_MESSAGE_BYTES, channel_options

SECRET_KEY = "x-headrace-core-secret"
SOCKET_MODE = 0o600


def _unix_path(address: str) -> str | None:
    return address[5:] if address.startswith("unix:") else None


def is_loopback(address: str) -> bool:
    """A unix socket, or TCP on a loopback interface."""
    parts = net.split_address(address)
    return parts is None or net.is_loopback(parts[0])


def check(address: str, tls: bool, secret: str | None, option: str = "--core-address") -> None:
    """ValueError for a core link the network could read or use: TCP beyond loopback without
    TLS or without the shared secret."""
    if is_loopback(address):
        return
    if not tls:
        raise ValueError(f"{option} {address} is beyond loopback: give the core TLS "
                         "(--core-tls-cert and --core-tls-key; the front ends --core-ca)")
    if not secret:
        raise ValueError(f"{option} {address} is beyond loopback: give the core and its front "
                         "ends a shared secret (--core-secret or $HEADRACE_CORE_SECRET)")


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds the core's ``address``: TLS on TCP when ``credentials`` are given; a unix socket
    created 0600 (umask while binding, then chmod). Returns the port (0: failed)."""
    path = _unix_path(address)
    if path is None:
        return security.bind(server, address, credentials)
    old = os.umask(0o177)
    try:
        port = server.add_insecure_port(address)
    finally:
        os.umask(old)
    restrict(address)
    return port


def restrict(address: str) -> None:
    """The unix socket at ``address`` (if any) is its owner's only."""
    path = _unix_path(address)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, SOCKET_MODE)


def interceptor(secret: str) -> grpc.aio.ServerInterceptor:
    """The core serves only callers presenting ``secret`` (health stays open)."""
    return security.AioSecretInterceptor(secret, SECRET_KEY, "this engine core serves only its "
                                         "API front ends (core secret)")


def metadata(secret: str | None) -> tuple:
    """What a front end adds to every call to the core."""
    return ((SECRET_KEY, secret),) if secret else ()


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A front end's channel to the core: TLS when ``credentials`` are given and the address is
    TCP."""
    options = channel_options(CORE_MAX_MESSAGE_BYTES)
    if credentials is not None and _unix_path(address) is None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)
