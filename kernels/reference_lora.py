"""Plain-torch reference of the batched LoRA update of multi-adapter serving (Punica's SGMV,
S-LoRA's and vLLM's shrink / expand): every token of a step may use another adapter, or none.

For a projection ``y = x @ W^T`` with adapters held in slots (the layer's stacked, zero-padded
buffers ``lora_a`` [slots, S x R, K] and ``lora_b`` [slots, N, R], R the rank limit, S the
projection's slices: 3 for a merged q/k/v, 2 for gate/up, 1 otherwise), a token t of slot s
gets ``y[t, slice i] += scale * (x[t] @ A_i^T) @ B_i^T`` where A_i is rows [i R, (i + 1) R) of
``lora_a[s]`` and B_i the rows of ``lora_b[s]`` of slice i's output columns. Two steps:

* ``lora_shrink``: ``buf[0, t] = x[t] @ lora_a[s]^T`` (float32) for the tokens of every slot;
  the Triton twin splits K over programs and writes ``buf[k, t]`` partials, so ``buf``'s first
  dimension is summed by the expand (here it has one entry);
* ``lora_expand``: ``y[t, slice i] += scale * sum_k buf[k, t, i R:(i + 1) R] @ B_i^T``, in
  place, only for the tokens of a slot (the others' rows of ``y`` and ``buf`` are not read).

Which tokens use which slot is ``LoraMeta``: the tokens grouped by slot (``order``) and the
work list of the Triton kernels, ``blocks``: every group cut into blocks of ``BLOCK_SIZES``
tokens, one (slot, start in ``order``, tokens) row each, a list per block size, its unused rows
zero (int32 on the device, of static sizes: CUDA graphs read them as static buffers); and the
same groups on the host as ``segments`` (slot, start, count), which is what this reference
reads (it runs where the forward pass runs from Python every step: CPU data planes and tests).
A step of T tokens over L slots has at most ceil(T / size) + min(L, T) blocks of a size
(``max_blocks``): the kernels' grids, which depend on T and L alone.
"""

from __future__ import annotations

import typing

import torch


BLOCK_SIZES = (16, 64)   # the kernels' token blocks: the fused small-step kernel's, the others'


class LoraMeta(typing.NamedTuple):
    order: torch.Tensor     # [>= tokens with a slot] int32: token indices, slot 0's first
    blocks: tuple           # per BLOCK_SIZES: [>= max_blocks, 3] int32 (slot, start, tokens) rows
    segments: tuple = ()    # ((slot, start, count), ...) on the host, slots with tokens only


def max_blocks(tokens: int, slots: int, size: int) -> int:
    """The most blocks of ``size`` tokens a step of ``tokens`` tokens over ``slots`` slots has."""
    return -(-tokens // size) + min(slots, tokens)


def block_rows(counts, size: int, rows: int):
    """numpy: the (slot, start, tokens) rows of ``counts`` tokens per slot (grouped in slot
    order) cut into blocks of ``size``, in an int32 [rows, 3] array (unused rows zero)."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    per = -(-counts // size)
    total = int(per.sum())
    first = np.repeat(np.cumsum(per) - per, per)
    index = np.arange(total) - first
    begin = np.repeat(starts, per) + index * size
    out = np.zeros((rows, 3), dtype=np.int32)
    out[:total, 0] = np.repeat(np.arange(len(counts)), per)
    out[:total, 1] = begin
    out[:total, 2] = np.minimum(size, np.repeat(starts + counts, per) - begin)
    return out


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraMeta,
                buf: torch.Tensor | None = None) -> torch.Tensor:
    """[1, tokens, S x R] float32: each slot's tokens' ``x @ lora_a[slot]^T`` (other rows 0)."""
    if buf is None:
        buf = torch.zeros((1, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    order = meta.order.long()
    for slot, start, count in meta.segments:
        rows = order[start:start + count]
        buf[0, rows] = (x[rows].float() @ lora_a[slot].float().t())
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta,
                slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """Adds each slot's tokens' update to ``y`` in place and returns it; ``slices``: the
    slices' output boundaries (0, end of slice 0, ..., y's width)."""
    rank = lora_b.shape[2]
    order = meta.order.long()
    h_all = buf.sum(0)
    for slot, start, count in meta.segments:
        rows = order[start:start + count]
        h = h_all[rows]
        update = torch.empty((count, slices[-1] - slices[0]), dtype=torch.float32, device=y.device)
        for i in range(len(slices) - 1):
            lo, hi = slices[i], slices[i + 1]
            b = lora_b[slot, lo:hi].float()
            update[:, lo - slices[0]:hi - slices[0]] = h[:, i * rank:(i + 1) * rank] @ b.t()
        y[rows, slices[0]:slices[-1]] += (scale * update).to(y.dtype)
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoraMeta, slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """``lora_expand(y, lora_shrink(x, ...), ...)``: the whole update, in place."""
    if not meta.segments:
        return y
    return lora_expand(y, lora_shrink(x, lora_a, meta), lora_b, meta, slices, scale)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta, slices: tuple[int, ...],
                sync: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``x @ weight^T (+ bias)``, rounded to x's type, then ``lora_add``: a projection and its
    update (the Triton twin does both in one launch for a decode; ``sync`` is its counters)."""
    from headrace.kernels import reference

    y = reference.linear(x, weight, bias)
    return lora_add(y if y.is_contiguous() else y.contiguous(), x, lora_a, lora_b, meta, slices, scale)


def lora_update(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                meta: LoraMeta, slices: tuple[int, ...], sync: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
    """``lora_add`` (the Triton twin runs it as one launch for a decode; ``sync``: its counters)."""
    return lora_add(y, x, lora_a, lora_b, meta, slices, scale)


def meta_of(token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
    """The ``LoraMeta`` of a per-token slot index (-1: no adapter), for tests and benchmarks
    (the data plane builds it from its host arrays: ``headrace.dataplane.lora.batch``)."""
    slots = token_slots.cpu().long()
    order = torch.argsort(slots, stable=True)
    order = order[(slots[order] >= 0)]
    counts = torch.bincount(slots[slots >= 0], minlength=num_slots)[:num_slots]
    starts = torch.cumsum(counts, 0) - counts
    segments = tuple((s, int(starts[s]), int(counts[s])) for s in range(num_slots) if counts[s])
    device, tokens = token_slots.device, len(slots)
    blocks = tuple(torch.from_numpy(block_rows(counts.numpy(), size,
                                               max_blocks(max(tokens, 1), num_slots, size))).to(device)
                   for size in BLOCK_SIZES)
    return LoraMeta(order.to(torch.int32).to(device), blocks, segments)
