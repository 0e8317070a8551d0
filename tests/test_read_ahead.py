"""``headrace.dataplane.read_ahead.ReadAhead``: a request stream read by a thread of its own, ahead
of its consumer, in order, with the source's error raised where it is read."""

from __future__ import annotations

import threading
import time

import pytest

from headrace.dataplane.read_ahead import ReadAhead


def test_messages_are_read_while_the_consumer_is_busy_and_come_in_order():
    read = []
    release = threading.Event()

    def source():
        for i in range(5):
            read.append(i)
            yield i
        release.wait(5)   # (a stream that stays open: the next message has not come)
        yield 5

    it = ReadAhead(source())
    deadline = time.monotonic() + 5
    while len(read) < 5 and time.monotonic() < deadline:   # nobody has called next yet
        time.sleep(0.001)
    assert read == [0, 1, 2, 3, 4]
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    release.set()
    assert list(it) == [5]
    with pytest.raises(StopIteration):
        next(it)


def test_an_error_of_the_source_is_raised_after_the_messages_before_it():
    def source():
        yield "a"
        raise RuntimeError("the RPC was cancelled")

    it = ReadAhead(source())
    assert next(it) == "a"
    with pytest.raises(RuntimeError, match="cancelled"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
