"""The host KV tier's memory and copy engine (``--kv-offloading-size``): a pool of KV blocks in
host memory (pinned on CUDA), and the block copies each step carries between it and the
device's KV cache, as the control plane's block manager decided them
(``controlplane.host_tier``).

The pool is block-major, ``[blocks, layers, 2, block_size, kv_heads, head_dim]``, so one host
block is one contiguous chunk: a swap-out gathers its device blocks, every layer's K and V,
into a device staging tensor (one kernel per layer) and copies each block to the host in
one transfer; a swap-in copies each host block to a staging tensor and scatters it into the
device blocks (one kernel per layer). A step's swap-outs come first, then its copy-on-write
copies, then its swap-ins, all before the step's forward pass.

On CUDA the copies run on a side stream: it waits for the work queued before the step (so a
block is saved after the steps that wrote it), and the step's forward waits for the gather
and the swap-ins only, never the host: nothing here synchronizes. The device-to-host
transfers of a swap-out overlap the forward, unless the step reads back a host block it
writes. Copy time is measured with events and reported once they are done (``drain``). On
the CPU the pool is a second tensor and the copies run at once (CI tests the logic so).
At start ``measure_load_rate`` times the swap-in's host-to-device transfers once (the
``WorkerInfo.host_kv_load_bytes_per_s`` that prices a host hit against recomputing it).
Under tensor parallelism each rank holds its own shard's pool and makes the same copies.
"""

from __future__ import annotations

import contextlib
import time

import torch

from dataplane.input_batch import BatchError
from dataplane.kv_cache import GiB, available_host_bytes

CHUNK_BLOCKS = 32   # blocks staged on the device at once (bounds the scratch memory)
_nothing = contextlib.nullcontext


def host_blocks_for(size_gib: float, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` a ``--kv-offloading-size`` of ``size_gib`` GiB holds;
    ValueError (one line) when the host cannot hold it."""
    if size_gib < 0:
        raise ValueError(f"--kv-offloading-size {size_gib}: must be >= 0 (GiB)")
    want = int(size_gib * GiB)
    have = available_host_bytes()
    if want > 0.9 * have:
        raise ValueError(f"--kv-offloading-size {size_gib:g}: only {have / GiB:.1f} GiB of host "
                         f"memory is available; ask for less")
    return want // block_bytes


def check_step(host: "HostKV | None", step) -> None:
    """BatchError unless the step's host-tier copies fit this worker's tiers."""
    out_dev, in_dev = step.swap_out_device_blocks, step.swap_in_device_blocks
    if host is not None:
        host.check(out_dev, step.swap_out_host_blocks, step.swap_in_host_blocks, in_dev)
    elif out_dev or in_dev or step.swap_out_host_blocks or step.swap_in_host_blocks:
        raise BatchError("swap_out/swap_in sent to a worker without a host KV tier")


def apply_step(host: "HostKV | None", caches: list[torch.Tensor], step, copy=None) -> None:
    """A step's block copies before its forward: the host tier's swap-outs, the copy-on-write
    copies (``copy()``), then the swap-ins (a fork's source block that its parent freed may be
    a swap-in's destination in the same step)."""
    out_dev, in_dev = step.swap_out_device_blocks, step.swap_in_device_blocks
    if host is not None and (out_dev or in_dev):
        host.apply(caches, list(out_dev), list(step.swap_out_host_blocks),
                   list(step.swap_in_host_blocks), list(in_dev), between=copy)
    elif copy is not None:
        copy()


class HostKV:
    def __init__(self, caches: list[torch.Tensor], num_blocks: int, device: torch.device):
        shape = caches[0].shape   # [2, blocks, block_size, kv_heads, head_dim]
        self.device, self.num_blocks = device, num_blocks
        self.num_device_blocks = shape[1]
        cuda = device.type == "cuda"
        # fp8 has few index kernels: its bytes are copied as such
        self._raw = caches[0].element_size() == 1
        dtype = torch.uint8 if self._raw else caches[0].dtype
        # every host block is written (a swap-out) before it is read: no need to zero it
        self.pool = torch.empty((num_blocks, len(caches), *shape[:1], *shape[2:]), dtype=dtype,
                                pin_memory=cuda)
        self.block_bytes = self.pool[0].numel() * self.pool.element_size()
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = []
        self._done = [0.0, 0, 0]   # ms, bytes out, bytes in (CPU: measured at once)

    def check(self, out_dev, out_host, in_host, in_dev) -> None:
        if not (out_dev or out_host or in_host or in_dev):
            return   # the common step: nothing to copy
        if len(out_dev) != len(out_host) or len(in_host) != len(in_dev):
            raise BatchError("swap_out/swap_in block lists differ in length")
        if any(b >= self.num_device_blocks for b in list(out_dev) + list(in_dev)) or \
                any(b >= self.num_blocks for b in list(out_host) + list(in_host)):
            raise BatchError("swap_out/swap_in: a block id out of range")

    def apply(self, caches: list[torch.Tensor], out_dev, out_host, in_host, in_dev, between=None) -> None:
        """The step's copies: device -> host, then ``between()`` (the step's copy-on-write
        copies, on the current stream), then host -> device; on CUDA queued on the side
        stream, the current stream made to wait for what the step's forward needs."""
        if self._raw:
            caches = [c.view(torch.uint8) for c in caches]
        if self.stream is None:
            t0 = time.perf_counter()
            self._swap_out(caches, out_dev, out_host)
            if between is not None:
                between()
            self._swap_in(caches, in_host, in_dev)
            self._done[0] += (time.perf_counter() - t0) * 1e3
            self._done[1] += len(out_dev) * self.block_bytes
            self._done[2] += len(in_dev) * self.block_bytes
            return
        main = torch.cuda.current_stream(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(main)   # after every op that wrote the blocks
        read_back = bool(set(out_host) & set(in_host))
        with torch.cuda.stream(self.stream):
            begin.record()
            staged = self._gather(caches, out_dev)
            if read_back:
                self._download(staged, out_host)
            gathered = torch.cuda.Event()
            gathered.record()
        main.wait_event(gathered)   # nothing overwrites a block before it is gathered
        if between is not None:
            between()
        if in_dev:
            self.stream.wait_stream(main)   # after the copy-on-write copies
        with torch.cuda.stream(self.stream):
            self._swap_in(caches, in_host, in_dev)
            ready = torch.cuda.Event()
            ready.record()
            if not read_back:
                self._download(staged, out_host)
            end.record()
        main.wait_event(ready)
        self._timing.append((begin, end, len(out_dev) * self.block_bytes, len(in_dev) * self.block_bytes))

    def measure_load_rate(self, repeats: int = 3) -> float:
        """Bytes per second the swap-in path moves host blocks to the device at: up to
        CHUNK_BLOCKS pool blocks copied block by block into a device staging tensor, on the
        copy stream, the best of ``repeats`` runs after an untimed one. The scatter into the
        KV cache that follows in a real swap-in is device-internal and left out (nothing is
        written to the cache here)."""
        n = min(self.num_blocks, CHUNK_BLOCKS)
        buf = torch.empty((n, *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
        best = float("inf")
        for run in range(repeats + 1):
            t0 = time.perf_counter()
            with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                for b in range(n):
                    buf[b].copy_(self.pool[b], non_blocking=True)
            if self.stream is not None:
                self.stream.synchronize()
            if run:
                best = min(best, time.perf_counter() - t0)
        return n * self.block_bytes / max(best, 1e-9)

    def _gather(self, caches, out_dev) -> list[tuple[torch.Tensor, int]]:
        """Device staging tensors ``[n, layers, 2, ...]`` holding the blocks to save."""
        staged = []
        for c in range(0, len(out_dev), CHUNK_BLOCKS):
            idx = self._index(out_dev[c:c + CHUNK_BLOCKS])
            buf = torch.empty((len(idx), *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
            for layer, cache in enumerate(caches):
                buf[:, layer] = cache.index_select(1, idx).transpose(0, 1)
            staged.append((buf, c))
        return staged

    def _index(self, blocks) -> torch.Tensor:
        """Block ids on the device; on CUDA from pinned memory (a pageable copy may wait for the
        stream, and the stream for the step before: the host would stall)."""
        ids = torch.as_tensor(list(blocks), dtype=torch.int64)
        if self.stream is None:
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _download(self, staged, out_host) -> None:
        for buf, c in staged:
            for i in range(buf.shape[0]):
                self.pool[out_host[c + i]].copy_(buf[i], non_blocking=True)

    def _swap_out(self, caches, out_dev, out_host) -> None:
        self._download(self._gather(caches, out_dev), out_host)

    def _swap_in(self, caches, in_host, in_dev) -> None:
        for c in range(0, len(in_dev), CHUNK_BLOCKS):
            hosts = in_host[c:c + CHUNK_BLOCKS]
            buf = torch.empty((len(hosts), *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
            for i, h in enumerate(hosts):
                buf[i].copy_(self.pool[h], non_blocking=True)
            idx = self._index(in_dev[c:c + CHUNK_BLOCKS])
            for layer, cache in enumerate(caches):
                cache.index_copy_(1, idx, buf[:, layer].transpose(0, 1))

    def drain(self) -> tuple[float, int, int]:
        """(copy ms, bytes out, bytes in) of the copies finished since the last call."""
        ms, out, into = self._done
        self._done = [0.0, 0, 0]
        pending = []
        for begin, end, o, i in self._timing:
            if end.query():
                ms += begin.elapsed_time(end)
                out += o
                into += i
            else:
                pending.append((begin, end, o, i))
        self._timing = pending
        return ms, out, into
