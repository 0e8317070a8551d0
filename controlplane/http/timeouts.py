"""Connection timeouts of the HTTP front end that uvicorn lacks: a request's head (its request
line and headers) must arrive within ``header_timeout`` seconds of the connection or of the
request's first byte, or the connection is closed (a "slowloris" client holds a connection,
and its buffers, for as long as it trickles its headers; uvicorn waits forever). Idle
keep-alive connections are closed by uvicorn's own ``timeout_keep_alive``.

``timed_protocol`` subclasses the HTTP protocol uvicorn would pick (httptools when installed,
else h11): with httptools the head starts at ``on_message_begin`` and ends at
``on_headers_complete``; with h11, a connection whose peer is still IDLE after bytes arrived is
inside a head, one whose peer sends a body or is done has its head complete."""

from __future__ import annotations

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
HTTP_TIMEOUTS = (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT)


class _HeadTimeout:
    """Closes the connection when a request head is not complete within ``header_timeout``."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    _head_timer = None

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_expired)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc) -> None:
        self._disarm_head()
        super().connection_lost(exc)

    # httptools
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head()

    def on_headers_complete(self) -> None:
        self._disarm_head()
        super().on_headers_complete()

    # h11
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        conn = getattr(self, "conn", None)
        if conn is not None and not self.transport.is_closing():
            import h11

            if conn.their_state is h11.IDLE:
                self._arm_head()
            else:
                self._disarm_head()


def timed_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT):
    """uvicorn's HTTP protocol class with the head timeout (for ``uvicorn.Config(http=...)``)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:   # httptools is not installed: uvicorn's h11 protocol
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"HeadTimeout{base.__name__}", (_HeadTimeout, base), {"header_timeout": header_timeout})
