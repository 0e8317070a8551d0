"""Shutdown that ends every stream (SIGTERM/SIGINT of a control-plane process, ``ControlPlane.
stop``): new requests are refused at once (UNAVAILABLE, health NOT_SERVING), open streams may
finish for up to the drain timeout (less half a second, for the last events to reach the
clients within it), then each one still open ends with a last event: a gRPC
stream with UNAVAILABLE "server is shutting down", an HTTP stream with an error event and
``data: [DONE]`` (``headrace.controlplane.http.streaming``), a non-streamed HTTP request with a 503.
Only then do the servers stop, with nothing left for them to cut (no cancelled handler, no
traceback)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from headrace.controlplane.requests.request import Failure

log = logging.getLogger("headrace.controlplane")
SHUTTING_DOWN = "server is shutting down; retry on another replica"
ENDING_S = 2.0   # how long the ended streams get to write their last event
MARGIN_S = 0.5   # the streams still open are ended this long before the drain timeout, so their
                 # last events reach the clients within it


async def end_streams(path, timeout: float) -> tuple[int, int]:
    """Stops ``path`` (a ``RequestPath``) admitting, waits up to ``timeout`` seconds for its
    open streams, then ends the rest with UNAVAILABLE; returns (finished, ended) streams."""
    path.shutting_down = True
    open_at_start = len(path.active)
    if open_at_start:
        log.info("shutting down: %d open streams get up to %.0fs to finish", open_at_start, timeout)
    deadline = time.monotonic() + max(0.0, timeout - min(MARGIN_S, timeout / 10))
    while path.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(path.active)
    for request in left:
        request.fail(Failure(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))
    deadline = time.monotonic() + ENDING_S
    while path.active and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if left:
        log.warning("shutting down: %d streams still open after %.0fs ended with UNAVAILABLE",
                    len(left), timeout)
    return open_at_start - len(left), len(left)
