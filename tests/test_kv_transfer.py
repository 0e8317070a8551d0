"""The host KV tier's copy ordering on a GPU (headrace.dataplane.kv_transfer), checked on a CPU
against a stand-in of torch.cuda that logs every stream wait and event: a step waits only for the
loads of the blocks it reads (never for the host, never for a download), loads start after the main
stream's queued work and after the stores into their host blocks, stores wait for the loads still
writing their device blocks or reading their host blocks, and finished copies are forgotten. On the
GPU: the copies themselves (tests/test_kv_offload.py, tests/test_kv_exactness.py)."""

from __future__ import annotations

import contextlib

import numpy as np

from headrace.dataplane.kv_transfer import Transfers


class FakeEvent:
    def __init__(self, log, enable_timing=False):
        self.log, self.stream, self.done = log, None, False

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return 2.0


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event))


class FakeCuda:
    """torch.cuda as kv_transfer uses it; the main stream is the current one."""

    def __init__(self):
        self.log, self.made = [], iter(["store", "load"])
        self.main = FakeStream(self.log, "main")
        self.current = self.main

    def Stream(self, device):  # noqa: N802 (torch.cuda's name)
        return FakeStream(self.log, next(self.made))

    def Event(self, enable_timing=False):  # noqa: N802
        return FakeEvent(self.log, enable_timing)

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


def _transfers():
    cuda = FakeCuda()
    return Transfers("cuda", cuda), cuda


def _main_waits(cuda):
    return [e for op, s, e in cuda.log if op == "wait_event" and s == "main"]


def _load(t, cuda, hosts, devs, chunk=1):
    ran = []
    t.load(hosts, devs, lambda h, d: ran.append((cuda.current.name, list(h), list(d))), chunk, 100)
    return ran


def test_a_step_waits_only_for_the_loads_of_the_blocks_it_reads():
    t, cuda = _transfers()
    ran = _load(t, cuda, [0, 1, 2], [5, 6, 7], chunk=2)
    assert ran == [("load", [0, 1], [5, 6]), ("load", [2], [7])]   # chunk by chunk, on the load stream
    assert _main_waits(cuda) == []                                  # queued: nobody waits yet
    first, second = t.loading[5], t.loading[7]
    assert t.loading[6] is first and first is not second
    t.wait_for(np.array([[9, 7, 3]], dtype=np.int32))                # a table with block 7 in it
    assert _main_waits(cuda) == [second]
    t.wait_for([1, 2, 3])                                            # nothing it reads is loading
    assert _main_waits(cuda) == [second]
    t.wait_for([[5, 6]])                                             # one chunk: waited for once
    assert _main_waits(cuda) == [second, first]


def test_a_load_starts_after_the_queued_steps_and_the_store_into_its_host_block():
    t, cuda = _transfers()
    staged = []
    t.store([3], [9], gather=lambda: staged.append(cuda.current.name) or "buf",
            download=lambda buf: staged.append((cuda.current.name, buf)), block_bytes=100)
    assert staged == ["store", ("store", "buf")]
    assert ("wait_stream", "store", "main") in cuda.log   # after the steps that wrote block 3
    gathered = [e for op, s, e in cuda.log if op == "record" and s == "store"][1]
    assert _main_waits(cuda) == [gathered]   # the main stream waits for the gather, not the download
    stored = t.host_written[9]
    assert stored is not gathered
    mark = len(cuda.log)
    _load(t, cuda, [9], [4])
    waits = cuda.log[mark:]
    assert ("wait_stream", "load", "main") in waits and ("wait_event", "load", stored) in waits
    assert waits.index(("wait_event", "load", stored)) < waits.index(next(x for x in waits if x[0] == "record"))


def test_a_store_waits_for_loads_still_writing_its_device_blocks_or_reading_its_host_blocks():
    t, cuda = _transfers()
    _load(t, cuda, [1], [5])
    _load(t, cuda, [2], [6])
    _load(t, cuda, [3], [7])
    into5, from2 = t.loading[5], t.host_read[2]
    mark = len(cuda.log)
    t.store([5], [2], gather=lambda: None, download=lambda buf: None, block_bytes=100)
    waits = [(s, e) for op, s, e in cuda.log[mark:] if op == "wait_event"]
    assert ("store", into5) in waits and ("store", from2) in waits
    assert not any(e is t.loading[7] for s, e in waits)   # an unrelated load


def test_finished_copies_are_forgotten_and_reported_once():
    t, cuda = _transfers()
    t.store([3], [9], gather=lambda: None, download=lambda buf: None, block_bytes=100)
    _load(t, cuda, [9, 8], [4, 5], chunk=32)
    assert t.pending == 2 and t.drain() == (0.0, 0, 0)
    for op, s, e in cuda.log:
        if op == "record":
            e.done = True
    assert t.pending == 0 and not t.host_written and not t.host_read
    t.wait_for([[4, 5]])
    assert _main_waits(cuda)[1:] == []   # the gather's wait only: the loads had landed
    assert t.drain() == (4.0, 100, 200) and t.drain() == (0.0, 0, 0)   # 2 ms a stream, bytes each way


def test_an_idle_tier_adds_no_wait():
    t, cuda = _transfers()
    t.wait_for(np.arange(100).reshape(4, 25))
    assert cuda.log == []
