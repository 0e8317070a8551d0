"""The host KV tier's memory and copy engine (``--kv-offloading-size``): a pool of KV blocks in
host memory (pinned on CUDA, allocated once at start), and the block copies each step carries
between it and the device's KV cache, as the control plane's block manager decided them
(``headrace.controlplane.kv.host_tier``).

The pool is block-major, ``[blocks, layers, 2, block_size, kv_heads, head_dim]``, so one host
block is one contiguous chunk: a swap-out gathers its device blocks, every layer's K and V,
into a device staging tensor (one kernel per layer) and copies each block to the host in
one transfer; a swap-in copies each host block to a staging tensor and scatters it into the
device blocks (one kernel per layer). A step's copies act as if they ran before its forward
pass, swap-outs first, then its copy-on-write copies, then its swap-ins.

On CUDA they do not run before it: ``headrace.dataplane.kv_transfer`` queues swap-outs and swap-ins
on two copy streams of their own and orders them by events, so the forward waits only for the gather
of the blocks it may overwrite and for the loads of the blocks it reads; a swap-in whose blocks a
later step reads (the control plane sends a waiting request's loads ahead of its compute:
``headrace.controlplane.kv.prefetch``) overlaps the steps between. Nothing here waits for the host.
On the CPU the pool is a second tensor and the copies run at once (CI tests the logic so). At start
``measure_load_rate`` times the load path itself (the ``WorkerInfo.host_kv_load_bytes_per_s`` that
prices a host hit against recomputing it). Under tensor parallelism each rank holds its own shard's
pool and makes the same copies.
"""

from __future__ import annotations

import time

import torch

from headrace.dataplane import kv_transfer
from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.kv_cache import GiB, available_host_bytes

CHUNK_BLOCKS = 32   # blocks staged on the device at once (bounds the scratch memory)


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


def apply_step(host: "HostKV | None", caches: list[torch.Tensor], step, copy=None, reads=None) -> None:
    """A step's block copies before its forward: the host tier's swap-outs, the copy-on-write
    copies (``copy()``), then the swap-ins (a fork's source block that its parent freed may be
    a swap-in's destination in the same step); on CUDA the forward then waits for the loads
    of ``reads`` (the device blocks it reads and writes), of this step or an earlier one."""
    out_dev, in_dev = step.swap_out_device_blocks, step.swap_in_device_blocks
    if host is None or not (out_dev or in_dev or host.loads_pending):   # the common step
        if copy is not None:
            copy()
        return
    cow = (step.copy_src_blocks, step.copy_dst_blocks) if copy is not None else ()
    host.apply(caches, list(out_dev), list(step.swap_out_host_blocks),
               list(step.swap_in_host_blocks), list(in_dev), between=copy,
               reads=reads, between_blocks=cow)


def runs(blocks) -> list[tuple[int, int, int]]:
    """(position, first block, length) of each run of consecutive ids in ``blocks``: one copy
    each between the pool and a staging tensor (the host tier hands out blocks in the order it
    freed them, so a sequence's blocks often come in runs; every copy costs a launch)."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == b:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


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
        self.transfers = kv_transfer.Transfers(device) if cuda else None
        self._done = [0.0, 0, 0]   # CPU: ms, bytes out, bytes in (measured at once)

    @property
    def loads_pending(self) -> bool:
        """Whether a load may still be writing a device block (CUDA only; may be stale-true)."""
        return self.transfers is not None and bool(self.transfers.loading)

    def check(self, out_dev, out_host, in_host, in_dev) -> None:
        if not (out_dev or out_host or in_host or in_dev):
            return   # the common step: nothing to copy
        if len(out_dev) != len(out_host) or len(in_host) != len(in_dev):
            raise BatchError("swap_out/swap_in block lists differ in length")
        if any(b >= self.num_device_blocks for b in list(out_dev) + list(in_dev)) or \
                any(b >= self.num_blocks for b in list(out_host) + list(in_host)):
            raise BatchError("swap_out/swap_in: a block id out of range")

    def apply(self, caches: list[torch.Tensor], out_dev, out_host, in_host, in_dev, between=None,
              reads=None, between_blocks=()) -> None:
        """The step's copies: device -> host, then ``between()`` (the step's copy-on-write
        copies of ``between_blocks``, on the current stream), then host -> device; on CUDA
        queued on the copy streams (``kv_transfer``), the current stream made to wait for
        what the step's forward reads (``reads``)."""
        if self._raw:
            caches = [c.view(torch.uint8) for c in caches]
        t = self.transfers
        if t is None:
            t0 = time.perf_counter()
            self._download(self._gather(caches, out_dev), out_host)
            if between is not None:
                between()
            self._upload(caches, in_host, in_dev)
            self._done[0] += (time.perf_counter() - t0) * 1e3
            self._done[1] += len(out_dev) * self.block_bytes
            self._done[2] += len(in_dev) * self.block_bytes
            return
        if out_dev:
            t.store(out_dev, out_host, lambda: self._gather(caches, out_dev),
                    lambda staged: self._download(staged, out_host), self.block_bytes)
        if between is not None:
            for blocks in between_blocks:   # a fresh block an earlier load may still write
                t.wait_for(blocks)
            between()
        if in_dev:
            t.load(in_host, in_dev, lambda hosts, devs: self._upload(caches, hosts, devs),
                   CHUNK_BLOCKS, self.block_bytes)
        if reads is not None:
            t.wait_for(reads)

    def measure_load_rate(self, caches: list[torch.Tensor], repeats: int = 3) -> float:
        """Bytes per second the load path moves host blocks to the device at: up to
        CHUNK_BLOCKS pool blocks copied block by block from pinned memory into a staging
        tensor and scattered into the KV cache, on the load stream (device time between two
        events), the best of ``repeats`` runs after an untimed one. Run at start, before any
        block holds KV: it writes zeros into the cache, as it was allocated."""
        if self._raw:
            caches = [c.view(torch.uint8) for c in caches]
        n = min(self.num_blocks, self.num_device_blocks, CHUNK_BLOCKS)
        blocks = list(range(n))
        self.pool[:n].zero_()   # the pool is not initialised; the cache's unwritten slots are zeros
        best = float("inf")
        for run in range(repeats + 1):
            if self.transfers is None:
                t0 = time.perf_counter()
                self._upload(caches, blocks, blocks)
                seconds = time.perf_counter() - t0
            else:
                stream = self.transfers.load_stream
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    begin.record(stream)
                    self._upload(caches, blocks, blocks)
                    end.record(stream)
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1e3
            if run:
                best = min(best, seconds)
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
        if self.transfers is None:
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _download(self, staged, out_host) -> None:
        for buf, c in staged:
            for i, h, n in runs(out_host[c:c + buf.shape[0]]):
                self.pool[h:h + n].copy_(buf[i:i + n], non_blocking=True)

    def _upload(self, caches, in_host, in_dev) -> None:
        """Host blocks ``in_host`` into device blocks ``in_dev``, CHUNK_BLOCKS at a time."""
        for c in range(0, len(in_dev), CHUNK_BLOCKS):
            hosts = in_host[c:c + CHUNK_BLOCKS]
            buf = torch.empty((len(hosts), *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
            for i, h, n in runs(hosts):
                buf[i:i + n].copy_(self.pool[h:h + n], non_blocking=True)
            idx = self._index(in_dev[c:c + CHUNK_BLOCKS])
            for layer, cache in enumerate(caches):
                cache.index_copy_(1, idx, buf[:, layer].transpose(0, 1))

    def drain(self) -> tuple[float, int, int]:
        """(copy ms, bytes out, bytes in) of the copies finished since the last call."""
        if self.transfers is not None:
            return self.transfers.drain()
        done, self._done = self._done, [0.0, 0, 0]
        return done[0], done[1], done[2]
