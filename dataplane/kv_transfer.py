"""The host KV tier's copies on a GPU, ordered by CUDA events so that none of them makes a
step wait for more than the blocks it reads, and none makes the host wait at all.

Hardware reason: PCIe is full duplex and idles while the GPU computes, so a host-to-device
load (a host-tier prefix hit, a swapped sequence resumed) and a device-to-host store (an
eviction's write-back, a swap preemption) each get a copy stream of their own and overlap
the forward passes on the main stream. What orders them (the rules of vLLM's offloading
connector and SGLang's HiCache, here per block):

* **A store** gathers its device blocks into a staging tensor on the store stream after every
  op queued on the main stream before its step (the steps that wrote them) and after any
  load still writing them; the main stream waits for the gather before its next op, so
  nothing overwrites a block before it is saved (its device copy is not reused until then).
  The device-to-host copy of the staged blocks then runs on while the GPU computes; the host
  blocks it writes remember its event.
* **A load** starts after every op queued on the main stream before its step (a fresh
  destination block may be one a step still in flight reads or writes: the control plane
  frees a sequence's blocks when it finishes, before its last steps ran), and after the
  stores still writing its host blocks. It lands chunk by chunk (``chunk`` blocks: a copy of
  each host block, then one scatter per layer); each chunk's event marks its device blocks,
  and its host blocks, which a later store must not overwrite before the chunk read them.
* **A step** waits (``wait_event`` on the main stream: a device-side wait, never a host sync)
  for the pending loads of the blocks it reads or writes, and for nothing else: a load sent
  ahead of the step that computes its sequence (a prefetch) overlaps the steps between.

Each stream's records complete in order; finished ones are forgotten as the next copies are
queued (``query``, which does not block). ``cuda`` is the ``torch.cuda`` namespace (a stand-in
in the CPU tests of these rules).
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import torch


class _Record:
    __slots__ = ("begin", "end", "device_blocks", "host_blocks", "bytes_out", "bytes_in")

    def __init__(self, begin, end, device_blocks, host_blocks, bytes_out=0, bytes_in=0):
        self.begin, self.end = begin, end
        self.device_blocks, self.host_blocks = device_blocks, host_blocks
        self.bytes_out, self.bytes_in = bytes_out, bytes_in


class Transfers:
    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.cuda, self.device = cuda, device
        self.store_stream = cuda.Stream(device)
        self.load_stream = cuda.Stream(device)
        self.loading: dict[int, object] = {}        # device block -> event of the load writing it
        self.host_written: dict[int, object] = {}   # host block -> event of the store writing it
        self.host_read: dict[int, object] = {}      # host block -> event of the load reading it
        self._stores: collections.deque[_Record] = collections.deque()
        self._loads: collections.deque[_Record] = collections.deque()
        self._chunks: collections.deque[_Record] = collections.deque()
        self._done = [0.0, 0, 0]   # copy ms, bytes out, bytes in of finished records

    def _event(self, timing: bool = False):
        return self.cuda.Event(enable_timing=timing)

    def _wait(self, stream, marks: dict[int, object], blocks) -> None:
        """``stream`` waits for the events ``marks`` holds for ``blocks`` (each event once)."""
        if not marks:
            return
        seen = set()
        for b in blocks:
            e = marks.get(b)
            if e is not None and id(e) not in seen:
                seen.add(id(e))
                stream.wait_event(e)

    def store(self, out_dev: list[int], out_host: list[int], gather: Callable, download: Callable,
              block_bytes: int) -> None:
        """Queues a step's swap-outs: ``gather()`` (device blocks -> a staging tensor, returned)
        then ``download(staged)`` (staging -> host blocks), on the store stream; the main
        stream waits for the gather."""
        self._prune()
        main = self.cuda.current_stream(self.device)
        s = self.store_stream
        s.wait_stream(main)
        self._wait(s, self.loading, out_dev)
        self._wait(s, self.host_read, out_host)
        begin, gathered, end = self._event(True), self._event(), self._event(True)
        begin.record(s)
        with self.cuda.stream(s):
            staged = gather()
            gathered.record(s)
            main.wait_event(gathered)
            download(staged)
        end.record(s)
        for h in out_host:
            self.host_written[h] = end
        self._stores.append(_Record(begin, end, (), tuple(out_host), bytes_out=len(out_dev) * block_bytes))

    def load(self, in_host: list[int], in_dev: list[int], upload: Callable, chunk: int,
             block_bytes: int) -> None:
        """Queues a step's swap-ins on the load stream, ``chunk`` blocks at a time
        (``upload(host_blocks, device_blocks)``); nothing waits for them here (``wait_for``)."""
        self._prune()
        main = self.cuda.current_stream(self.device)
        s = self.load_stream
        s.wait_stream(main)
        self._wait(s, self.host_written, in_host)
        begin, end = self._event(True), self._event(True)
        begin.record(s)
        with self.cuda.stream(s):
            for c in range(0, len(in_dev), chunk):
                hosts, devs = in_host[c:c + chunk], in_dev[c:c + chunk]
                upload(hosts, devs)
                landed = self._event()
                landed.record(s)
                for d in devs:
                    self.loading[d] = landed
                for h in hosts:
                    self.host_read[h] = landed
                self._chunks.append(_Record(None, landed, tuple(devs), tuple(hosts)))
        end.record(s)
        self._loads.append(_Record(begin, end, (), (), bytes_in=len(in_dev) * block_bytes))

    def wait_for(self, blocks) -> None:
        """The main stream waits for the pending loads of ``blocks`` (device block ids, any
        shape; ids a table holds beyond its sequence's length only make it wait longer)."""
        if not self.loading:
            return
        self._prune()
        if not self.loading:
            return
        pending = np.fromiter(self.loading, dtype=np.int64, count=len(self.loading))
        read = pending[np.isin(pending, np.asarray(blocks, dtype=np.int64).ravel())]
        if len(read):
            self._wait(self.cuda.current_stream(self.device), self.loading, read.tolist())

    @property
    def pending(self) -> int:
        """Device blocks whose load may still be running."""
        self._prune()
        return len(self.loading)

    def _prune(self) -> None:
        """Forgets the marks of finished copies (each stream's records finish in order)."""
        chunks = self._chunks
        while chunks and chunks[0].end.query():
            r = chunks.popleft()
            for d in r.device_blocks:
                if self.loading.get(d) is r.end:
                    del self.loading[d]
            for h in r.host_blocks:
                if self.host_read.get(h) is r.end:
                    del self.host_read[h]
        for records, direction in ((self._stores, 1), (self._loads, 2)):
            while records and records[0].end.query():
                r = records.popleft()
                self._done[0] += r.begin.elapsed_time(r.end)
                self._done[direction] += r.bytes_out if direction == 1 else r.bytes_in
                for h in r.host_blocks:
                    if self.host_written.get(h) is r.end:
                        del self.host_written[h]

    def drain(self) -> tuple[float, int, int]:
        """(copy ms, bytes out, bytes in) of the copies finished since the last call: each
        stream's busy time, summed."""
        self._prune()
        done, self._done = self._done, [0.0, 0, 0]
        return done[0], done[1], done[2]
