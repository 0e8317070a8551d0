"""Reads a gRPC request stream ahead of the thread that serves it.

gRPC Python's synchronous server asks its core for a stream's next message only when the
servicer calls ``next`` on the request iterator; the message then comes back through the
server's completion-queue thread, a thread hand-off after the servicer was already free.
A worker thread that launched a step and answered the one before reads its next message
that way on the critical path of a constrained token (the late bitmasks: measured on the
H200 at ~0.6 ms from the control plane's send to the worker's read, where the wire takes
~0.1 ms). ``ReadAhead`` keeps a read posted at all times from a thread of its own, so a
message that has arrived is already in a queue when the servicer asks for it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

_END = object()


class ReadAhead:
    """Iterates over ``source`` (a request iterator) from a daemon thread; ``next`` returns
    what it has read, in order, and re-raises an error the source raised (a cancelled RPC)
    once the messages before it are taken."""

    def __init__(self, source: Iterator, name: str = "read-ahead"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(source,), name=name, daemon=True)
        self._thread.start()

    def _read(self, source: Iterator) -> None:
        try:
            for message in source:
                self._queue.put(message)
        except BaseException as exc:   # (the RPC ended: raised where it is read)
            self._queue.put(exc)
            return
        self._queue.put(_END)

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self):
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)   # (a later ``next`` ends too)
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(_END)
            raise item
        return item
