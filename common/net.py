"""Listening addresses both planes share the rules of: a port already in use fails start-up
(gRPC sets SO_REUSEPORT by default, which would let a second server share the port silently),
and whether a host is loopback-only or open to the network.

``check_port`` and ``GRPC_EXCLUSIVE_PORT`` are the one place that decides whether a port may
be shared. The API front ends of one server share its ports by design (``GRPC_SHARED_PORT``,
SO_REUSEPORT on the HTTP socket): their supervisor runs ``check_port`` once before starting
them, so a port another server holds is still refused."""

from __future__ import annotations

import ipaddress
import socket

# gRPC server option: no SO_REUSEPORT, so binding a port in use fails
GRPC_EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
# gRPC server option of API front ends sharing one port (the kernel spreads the connections)
GRPC_SHARED_PORT = ("grpc.so_reuseport", 1)


class PortInUse(OSError):
    """The address to listen on is taken by another process."""


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` / ``[v6]:port``; None for ``unix:`` paths."""
    if address.startswith("unix:"):
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(address: str, what: str = "--port") -> None:
    """Raises PortInUse when ``address`` (``host:port``) cannot be bound exclusively. Port 0
    (ephemeral) and unix sockets always pass."""
    parts = split_address(address)
    if parts is None or parts[1] == 0:
        return
    host, port = parts
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {address}: unknown host {host!r} ({exc.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as servers do: TIME_WAIT is fine
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise PortInUse(f"cannot listen on {address}: {exc.strerror.lower() if exc.strerror else exc} "
                            f"(another server on port {port}? choose another {what} or stop it)") from None


def bind_exclusive(server, address: str, bind) -> int:
    """``bind(server, address)`` after ``check_port``; a failed bind is PortInUse too (the
    port was taken between the check and the bind). Returns the bound port."""
    check_port(address)
    try:
        port = bind(server, address)
    except RuntimeError:
        port = 0
    if port == 0 and not address.startswith("unix:"):
        raise PortInUse(f"cannot listen on {address} (in use or not an address of this machine)")
    return port
