"""Moves a step's small host arrays to the device in one transfer that never stalls the host.

A copy from pageable host memory makes the CUDA driver wait for every kernel already queued on
the stream before it starts, so a step that uploads its inputs that way cannot be launched
while the step before it still runs: the GPU idles while the host prepares. ``upload`` packs
every array of a step into one pinned buffer (grouped by dtype, each array 16-byte aligned:
Triton specialises kernels on whether a pointer is 16-byte aligned, so arrays at varying
alignments would make steps of new shapes compile kernels while the device waits), copies it
with a single asynchronous transfer and hands back typed device views of it. Pinned buffers come from
torch's caching host allocator, which does not reuse a buffer before the copy that read it
has run, so steps can be in flight back to back without overwriting each other's inputs.

``Stager`` does the same from persistent pinned buffers (a ring of a few, grown to the largest
step seen), the runner's per-step upload: no pinned allocation per step, and a buffer is reused
only once the copy that read it has run (its event, normally long done). Its two halves can
run apart: ``pack`` (host work: a step prepared while the device still owes the step before
its sampling) and ``copy`` (the transfer, queued when the step is launched, in stream order).

``download`` is the other direction: an asynchronous copy into pinned memory, read by the
host after the step's completion event (never a ``.tolist()`` on a device tensor, which would
wait for every later step queued behind it too).
"""

from __future__ import annotations

import typing

import numpy as np
import torch

_ALIGN = 16


def upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The same arrays on ``device`` (names kept); on the CPU they share the numpy memory."""
    if device.type != "cuda":
        return {k: torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else a.copy())
                for k, a in arrays.items()}
    return packed_copy(arrays, device, pin=True)


class Stager:
    """A runner's uploads through ``depth`` persistent pinned host buffers, used in turn."""

    def __init__(self, device: torch.device, depth: int = 4, capacity: int = 1 << 16):
        self.device, self.depth = device, depth
        cuda = device.type == "cuda"
        self._buffers = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
                         for _ in range(depth)] if cuda else []
        self._copied = [torch.cuda.Event() for _ in range(depth)] if cuda else []
        self._used = [False] * depth
        self._next = 0

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """As ``upload``: the arrays on the device, from one copy of one pinned buffer."""
        return self.copy(self.pack(arrays))

    def pack(self, arrays: dict[str, np.ndarray]) -> "Packed":
        """The host half of ``upload``: the arrays packed into the next pinned buffer, no
        device work queued (a step prepared while the device still owes an earlier step's
        sampling). ``copy`` queues the transfer; the buffer is not reused before it has run."""
        if self.device.type != "cuda":
            return Packed(arrays, None, 0, None, -1)
        layout, total = layout_of(arrays)
        i, self._next = self._next, (self._next + 1) % self.depth
        if self._used[i]:
            self._copied[i].synchronize()   # the copy that read this buffer last has run
        if total > self._buffers[i].numel():
            self._buffers[i] = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
        host = self._buffers[i][:max(total, _ALIGN)]
        _pack(arrays, layout, host)
        self._used[i] = False   # (until its copy is queued, nothing reads it)
        return Packed(arrays, layout, total, host, i)

    def copy(self, packed: "Packed") -> dict[str, torch.Tensor]:
        """Queues ``packed``'s transfer; the typed device views of the arrays."""
        if packed.host is None:
            return upload(packed.arrays, self.device)
        out = views_of(packed.arrays, packed.layout, packed.host.to(self.device, non_blocking=True))
        self._copied[packed.slot].record()
        self._used[packed.slot] = True
        return out


class Packed(typing.NamedTuple):
    """Arrays packed into a pinned buffer, their transfer not queued yet (``Stager.pack``)."""
    arrays: dict[str, np.ndarray]
    layout: list | None
    total: int
    host: torch.Tensor | None   # None on a CPU: nothing to pack
    slot: int


def layout_of(arrays: dict[str, np.ndarray]) -> tuple[list, int]:
    """Where each array goes in the packed buffer: [(dtype, byte offset, elements, [(name,
    start, stop)])] and the buffer's size in bytes."""
    groups: dict[np.dtype, list[str]] = {}
    for name, a in arrays.items():
        groups.setdefault(a.dtype, []).append(name)
    layout, total = [], 0     # (dtype, byte offset, [(name, start, stop)])
    for dtype, names in groups.items():
        parts, n, step = [], 0, max(1, _ALIGN // dtype.itemsize)
        for name in names:
            size = arrays[name].size
            parts.append((name, n, n + size))
            n += -(-size // step) * step   # every array starts 16-byte aligned (see below)
        layout.append((dtype, total, n, parts))
        total += -(-n * dtype.itemsize // _ALIGN) * _ALIGN
    return layout, total


def packed_copy(arrays: dict[str, np.ndarray], device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
    """One host buffer holding every array, one copy of it to ``device``, typed views back.
    Arrays are grouped by dtype, so each group is one typed view of the copy, sliced per array."""
    layout, total = layout_of(arrays)
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    return _copy(arrays, layout, total, host, device)


def _copy(arrays: dict[str, np.ndarray], layout: list, total: int, host: torch.Tensor,
          device: torch.device) -> dict[str, torch.Tensor]:
    """Packs ``arrays`` into ``host`` by ``layout``, copies it to ``device`` in one transfer and
    returns the typed views of the copy."""
    _pack(arrays, layout, host)
    return views_of(arrays, layout, host.to(device, non_blocking=True))


def _pack(arrays: dict[str, np.ndarray], layout: list, host: torch.Tensor) -> None:
    host_np = host.numpy()
    for dtype, offset, n, parts in layout:
        typed = host_np[offset:offset + n * dtype.itemsize].view(dtype)
        for name, lo, hi in parts:
            typed[lo:hi] = arrays[name].reshape(-1)


def views_of(arrays: dict[str, np.ndarray], layout: list, dev: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each array's typed view of the device copy ``dev`` of the packed buffer."""
    out = {}
    for dtype, offset, n, parts in layout:
        typed = dev[offset:offset + n * dtype.itemsize].view(_TORCH_DTYPES[dtype])
        for name, lo, hi in parts:
            shape = arrays[name].shape
            out[name] = typed[lo:hi] if len(shape) == 1 else typed[lo:hi].view(shape)
    return {name: out[name] for name in arrays}


def download(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of ``t`` to (pinned) host memory; valid once the stream has passed
    this point (synchronise an event recorded after it)."""
    if not t.is_cuda:
        return t
    return t.to("cpu", non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.uint8): torch.uint8}
