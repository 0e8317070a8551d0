"""The requests an API front end keeps while its engine core is away (``Parked``, a part of
``headrace.controlplane.frontend.client.CoreClient``): a core that crashed and is restarted by its
supervisor comes back in about a second, and the front end holds everything a request needs to
go on (its prompt, sampling, the tokens each sample had, what its client has received).

When the core is lost the client's requests are parked instead of failed; their clients' streams
pause (health NOT_SERVING meanwhile, new requests refused UNAVAILABLE). Once the core is ready
again each parked request is submitted anew with its samples' tokens (``Submit.resumed``): the
core recomputes their KV (through its prefix cache) and generation goes on from the next
token, the same one as without the crash for greedy and seeded sampling. Stop strings keep
being matched here on the text already fed; finished samples of an ``n > 1`` request are not
sent again. A request whose client left meanwhile is dropped; one still parked after
``deadline_s`` fails UNAVAILABLE, and so does every one when the front end stops or the core
comes back serving another model."""

from __future__ import annotations

import asyncio
import time

import grpc

from headrace.common.logs import get_logger
from headrace.controlplane.requests.request import Failure, Request

log = get_logger("headrace.frontend")


class Parked:
    def __init__(self, client, deadline_s: float = 60.0):
        self.client = client   # headrace.controlplane.frontend.client.CoreClient
        self.deadline_s = deadline_s
        self._requests: dict[str, Request] = {}
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def keep(self, requests: list[Request]) -> None:
        """``requests`` wait for the core (those already finished or failed need nothing)."""
        for request in requests:
            if not request.finished and request.failure is None:
                self._requests[request.request_id] = request
        if self._requests and self._timer is None:
            self._since = time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(self.deadline_s, self._expired)

    def drop(self, request: Request) -> None:
        """Its client left: it is not resumed."""
        if self._requests.pop(request.request_id, None) is not None and not self._requests:
            self._stop_timer()

    def resubmit(self) -> None:
        """The core is ready again: every parked request goes to it with the tokens it had."""
        requests, self._requests = list(self._requests.values()), {}
        waited = time.monotonic() - self._since if self._since is not None else 0.0
        self._stop_timer()
        resumed = 0
        for request in requests:
            if not request.finished and request.failure is None:
                self.client.submit(request, resume=True)
                resumed += 1
        if resumed:
            log.warning("engine core back: its requests resume where their streams stopped",
                        address=self.client.address, requests=resumed, waited_s=round(waited, 3))

    def fail_all(self, message: str) -> None:
        requests, self._requests = list(self._requests.values()), {}
        self._stop_timer()
        for request in requests:
            request.fail(Failure(grpc.StatusCode.UNAVAILABLE, message))
        if requests:
            log.error("requests kept for the engine core fail", reason=message, requests=len(requests))

    def _expired(self) -> None:
        self._timer = None
        self.fail_all(f"the engine core did not come back within {self.deadline_s:g}s; retry")

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._since = None
