"""Waiting for a benchmark's own server: until it is ready, or until it is gone. A server that
exits before it is ready (a model that cannot load, a module that cannot be imported) ends the
benchmark at once with its exit status, where waiting on the client's readiness alone would
hold a GPU call for the whole timeout."""

from __future__ import annotations

import asyncio
import subprocess

from headrace.client import AsyncClient, NotReady


async def wait_ready_async(address: str, server: subprocess.Popen | None = None,
                           timeout: float = 900.0) -> None:
    """SystemExit (one line) when ``server`` exits first or the wait times out."""
    async def gone():
        while server.poll() is None:
            await asyncio.sleep(0.5)
        raise SystemExit(f"the server exited with status {server.returncode} before it was ready")

    ready = asyncio.ensure_future(AsyncClient(address).wait_ready(timeout))
    watch = asyncio.ensure_future(gone()) if server is not None else None
    try:
        done, _ = await asyncio.wait({t for t in (ready, watch) if t is not None},
                                     return_when=asyncio.FIRST_COMPLETED)
        done.pop().result()
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        for task in (ready, watch):
            if task is not None and not task.done():
                task.cancel()


def wait_ready(address: str, server: subprocess.Popen | None = None, timeout: float = 900.0) -> None:
    asyncio.run(wait_ready_async(address, server, timeout))
