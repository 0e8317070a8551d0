"""ASGI responses that watch the client: the work (generation, then sending) runs in one task
raced against ``http.disconnect``; a client that leaves cancels it, which closes the request
path's generator and so aborts the request and frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.protocol import error_body

log = logging.getLogger("headrace.http")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]


async def send_json(send, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Watched(Response):
    """(A starlette ``Response`` only so FastAPI passes it through.) Runs ``work(send)`` until it is
    done or the client disconnects; ``on_gone`` is called when the client left first. ``HttpError``
    raised before anything was sent becomes its OpenAI error object (and ``on_error(exc)``)."""

    def __init__(self, work: Callable[[Callable], Awaitable[None]], on_gone=None, on_error=None):
        self.work, self.on_gone, self.on_error = work, on_gone, on_error
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def tracked_send(message):
            nonlocal started
            started = True
            await send(message)

        async def run():
            try:
                await self.work(tracked_send)
            except HttpError as exc:
                if started:
                    raise
                if self.on_error is not None:
                    self.on_error(exc)
                await send_json(send, exc.status, exc.body())
            except Exception:   # a bug: logged here, never shown to the client
                log.exception("unexpected error while answering")
                if not started:
                    await send_json(send, 500, error_body("internal server error", "server_error"))

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                if self.on_gone is not None:
                    self.on_gone()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task


def event_stream(chunks: AsyncIterator[bytes], on_gone=None, on_error=None) -> Watched:
    """Server-sent events: the first chunk is awaited before the 200 goes out, so refusals
    (validation, queue full, not ready) get their HTTP status."""

    async def work(send) -> None:
        async with contextlib.aclosing(chunks) as it:
            first = await anext(it, None)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in it:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return Watched(work, on_gone, on_error)


def json_result(compute: Callable[[], Awaitable[dict]], on_gone=None, on_error=None) -> Watched:
    async def work(send) -> None:
        await send_json(send, 200, await compute())

    return Watched(work, on_gone, on_error)
