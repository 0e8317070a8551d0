"""What every control-plane server process shares, without the API stack (the HTTP front end,
reflection): the health of the served services (SERVING only while ready), fire-and-forget
background tasks, and running a server until a signal. The engine core imports only this, so
it starts (and restarts, while its front ends answer UNAVAILABLE) without loading FastAPI."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from grpc_health.v1 import health, health_pb2

from headrace.v1 import admin_pb2 as apb
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.controlplane")

INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = apb.DESCRIPTOR.services_by_name["Admin"].full_name


async def set_health(servicer: health.aio.HealthServicer, ready: bool) -> None:
    """Inference (and the server as a whole, "") is SERVING only while ``ready``."""
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", INFERENCE):
        await servicer.set(name, status)


class BackgroundTasks:
    """Fire-and-forget tasks kept referenced until done."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def run_until_signal(server, grace: float | None = None, stop_hook=None) -> None:
    """Starts ``server`` (anything with ``start()`` and ``stop(grace)``) and runs it until
    SIGINT/SIGTERM, or until the function ``stop_hook`` is handed is called (from any thread);
    start-up errors are raised. ``grace``: what ``stop`` gets (default the server's
    ``drain_timeout``, else 10 s). A second SIGINT while it stops ends the process at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    grace = grace if grace is not None else getattr(server, "drain_timeout", 10.0)

    def on_signal(sig):
        if stop.is_set() and sig == signal.SIGINT:
            log.warning("second SIGINT: exiting now")
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    if stop_hook is not None:
        stop_hook(lambda: loop.call_soon_threadsafe(stop.set))
    starting = asyncio.create_task(server.start())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done:
        starting.result()  # raise start-up errors
        await waiter
    else:
        starting.cancel()
    log.info("shutting down")
    await server.stop(grace)
