"""Runs the HTTP front end with uvicorn inside the control plane's asyncio loop, beside the
gRPC aio server: binds its socket at start (so a taken port fails start-up), leaves signal
handling to the control plane, and stops gracefully with it. A port in use is ``PortInUse``
(one line from the command line, as for the gRPC port). A connection is closed when a request's
headers do not arrive within ``header_timeout`` seconds, or when it idles ``keep_alive_timeout``
seconds between requests (``headrace.controlplane.http.timeouts``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from headrace.common import net
from headrace.controlplane.http import timeouts
from headrace.controlplane.http.app import MAX_BODY_BYTES, build_app
from headrace.controlplane.requests.path import RequestPath


def http_host(grpc_address: str) -> str:
    """The host of the gRPC address (HTTP binds the same one); loopback for unix sockets."""
    if grpc_address.startswith("unix:"):
        return "127.0.0.1"
    host = grpc_address.rsplit(":", 1)[0]
    return host.strip("[]") or "0.0.0.0"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):   # the control plane owns SIGINT/SIGTERM
        yield


class HttpFrontEnd:
    """``port`` 0 binds an ephemeral port (``self.port`` says which after ``start``).
    ``ssl``: (certfile, keyfile, client CA or None) to serve HTTPS. ``reuse_port``: bind
    with SO_REUSEPORT (several front-end processes serve one port)."""

    def __init__(self, path: RequestPath, host: str, port: int, api_token=None, *,
                 tensor_parallel_size: int = 1, ssl: tuple | None = None, reuse_port: bool = False,
                 max_body: int = MAX_BODY_BYTES, header_timeout: float = timeouts.DEFAULT_HEADER_TIMEOUT,
                 keep_alive_timeout: float = timeouts.DEFAULT_KEEP_ALIVE_TIMEOUT, lora_admin=None):
        self.host, self.port, self.reuse_port = host, port, reuse_port
        self.app = build_app(path, api_token, tensor_parallel_size, max_body, lora_admin)
        options = {}
        if ssl is not None:
            import ssl as ssl_module

            cert, key, ca = ssl
            options = dict(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=ca,
                           ssl_cert_reqs=ssl_module.CERT_REQUIRED if ca else ssl_module.CERT_NONE)
        self.config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                     http=timeouts.timed_protocol(header_timeout),
                                     timeout_keep_alive=keep_alive_timeout, server_header=False, **options)
        self.server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
        # without it Nagle's algorithm holds the first SSE chunk back ~40 ms (delayed ACK)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.reuse_port:   # API front ends share the port (the kernel spreads connections)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise net.PortInUse(f"cannot listen on {self.host}:{self.port} for HTTP: "
                                f"{(exc.strerror or str(exc)).lower()} (another server on port "
                                f"{self.port}? choose another --http-port, or 0 to disable)") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.server = _Server(self.config)
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name="headrace-http")
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()   # raise its start-up error

    async def stop(self, grace: float = 10.0) -> None:
        if self.server is None:
            return
        self.server.config.timeout_graceful_shutdown = grace
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, grace + 5)
