"""The client-facing latencies of one response stream: time to first token, inter-token latency
and end-to-end latency, observed where the request path hands its responses to the client's
stream (gRPC or HTTP), in the process that serves the client: the API front end under
``headrace serve``, the one process of an in-process ``ControlPlane``. The engine (the engine
core) never observes them, so each is counted once whatever the layout.

- TTFT: from the moment the request path received the request (before tokenisation) to the
  first response with a token handed to the client.
- ITL: per sample, a response of k tokens handed over g seconds after the sample's previous one
  counts k observations of g / k (a coalesced burst is spread over its tokens, so the sum is
  the sample's time from its first response to its last); the tokens of a sample's first
  response have no gap to measure and are not observed.
- e2e: from receipt to the last response, for requests that finished (none aborted).
"""

from __future__ import annotations

import time

from headrace.v1 import inference_pb2 as pb


class StreamLatency:
    __slots__ = ("metrics", "received", "first", "last")

    def __init__(self, metrics, received: float | None = None):
        self.metrics = metrics               # headrace.controlplane.metrics.ControlPlaneMetrics
        self.received = time.monotonic() if received is None else received
        self.first = False                   # the request's first token was handed over
        self.last: dict[int, float] = {}     # sample index -> when its last tokens were handed over

    def handing(self, responses: list[pb.GenerateResponse]) -> float:
        """``responses`` (one wake-up's) go to the client now; returns now."""
        now, m, last = time.monotonic(), self.metrics, self.last
        for msg in responses:
            k = len(msg.token_ids)
            if not k:
                continue
            if not self.first:
                self.first = True
                m.ttft.observe(now - self.received)
            before = last.get(msg.index)
            if before is not None:
                m.itl.observe_n((now - before) / k, k)
            last[msg.index] = now
        return now

    def finished(self, now: float) -> None:
        """The last responses were handed over at ``now`` and no sample was aborted."""
        self.metrics.e2e.observe(now - self.received)
