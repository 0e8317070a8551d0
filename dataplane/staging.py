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

``download`` is the other direction: an asynchronous copy into pinned memory, read by the
host after the step's completion event (never a ``.tolist()`` on a device tensor, which would
wait for every later step queued behind it too).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16


def upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The same arrays on ``device`` (names kept); on the CPU they share the numpy memory."""
    if device.type != "cuda":
        return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    return packed_copy(arrays, device, pin=True)


def packed_copy(arrays: dict[str, np.ndarray], device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
    """One host buffer holding every array, one copy of it to ``device``, typed views back.
    Arrays are grouped by dtype, so each group is one typed view of the copy, sliced per array."""
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
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    host_np = host.numpy()
    for dtype, offset, n, parts in layout:
        typed = host_np[offset:offset + n * dtype.itemsize].view(dtype)
        for name, lo, hi in parts:
            typed[lo:hi] = arrays[name].reshape(-1)
    dev = host.to(device, non_blocking=True)
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
