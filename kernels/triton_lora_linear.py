"""Triton twin of ``headrace.kernels.reference_lora.lora_linear``: a decode step's projection
with its LoRA update in one launch, ``x @ W^T (+ bias) + scale * (x @ A_s^T) @ B_s^T`` for the
rows of each adapter slot s, for steps of at most ``MAX_ROWS`` tokens.

Why: at batch 1-16 a projection is bound by reading its weight, and a separate LoRA kernel
after it (``headrace.kernels.triton_lora``'s fused update) is a dependent graph node of its own
whose serial K loop over the adapter's A costs more than its arithmetic: ~6.5 µs a projection
measured on an H100 (W2 1.47x on Qwen3-0.6B, docs/lora.md). Here each program, while it
streams its [BLOCK_N, K] slice of W from HBM (as ``headrace.kernels.triton_linear``'s skinny
kernel does), also reads the first slot's A ([S x R, BLOCK_K] a step, a few hundred kilobytes
shared by every program, so from L2) and accumulates ``h = x @ A^T`` for that slot's rows in
the same loop; its epilogue adds ``h_i @ B_i^T`` to the columns of slice i it owns, in float32
before the one rounding. A step's further slots (tokens of other adapters in the same few-token
step) each take a pass of their own over K after the main loop (x and A from L2). So a
one-adapter decode adds no launch and no serial loop; rows of no adapter get exactly the
skinny GEMM.
"""

from __future__ import annotations

import typing

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.reference_lora import BLOCK_SIZES, LoraMeta, max_blocks
from headrace.kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there
from headrace.kernels.triton_lora import MAX_SLICES, _slice_dot

MAX_ROWS = BLOCK_SIZES[0]    # one 16-row block: every row of the step in each program


class Launch(typing.NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


# (n, k, slices) -> Launch: the winners of ``python -m bench.lora_kernels --sweep-linear``
PINNED: dict[tuple[int, int, int], Launch] = {}


def launch_for(n: int, k: int, slices: int, element_size: int) -> Launch:
    """The skinny GEMM's tiles (``headrace.kernels.triton_linear._tiles``), and for long rows
    (which it leaves to torch's GEMM) 16 columns a program."""
    if element_size >= 4:
        return Launch(32, 64, 4, 2)
    pinned = PINNED.get((n, k, slices))
    if pinned is not None:
        return pinned
    if n >= 6144:
        return Launch(64, 256, 4, 3)
    if n >= 4096:
        return Launch(32, 128, 4, 4)
    return Launch(16, 256, 4, 3)


@triton.jit
def _group(ORDER, BLOCKS, blk, rows, BLOCK_M: tl.constexpr):
    """(slot, which of the step's rows are its tokens, how many) of block ``blk``."""
    slot = tl.load(BLOCKS + 3 * blk)
    start = tl.load(BLOCKS + 3 * blk + 1)
    count = tl.load(BLOCKS + 3 * blk + 2)
    j = tl.arange(0, BLOCK_M)
    idx = tl.load(ORDER + start + j, mask=j < count, other=-1)
    member = tl.max((idx[None, :] == rows[:, None]).to(tl.int32), axis=1) > 0
    return slot.to(tl.int64), member, count


@triton.jit
def _shrink_step(x, member, a_base, r, r_live, k, k_ok, R, stride_an, h0, h1, h2,
                 SLICES: tl.constexpr, PRECISION: tl.constexpr):
    """h_i += x[member rows] @ A_i[:, k]^T for the slices of one K step (``r_live``: the
    rank's rows, none when the slot has no token: nothing is read)."""
    xg = tl.where(member[:, None], x, 0.0)
    mask = r_live[:, None] & k_ok[None, :]
    a = tl.load(a_base + r[:, None] * stride_an + k[None, :], mask=mask, other=0.0).to(x.dtype)
    h0 = tl.dot(xg, tl.trans(a), h0, input_precision=PRECISION)
    if SLICES > 1:
        a = tl.load(a_base + (R + r)[:, None] * stride_an + k[None, :], mask=mask, other=0.0).to(x.dtype)
        h1 = tl.dot(xg, tl.trans(a), h1, input_precision=PRECISION)
    if SLICES > 2:
        a = tl.load(a_base + (2 * R + r)[:, None] * stride_an + k[None, :], mask=mask,
                    other=0.0).to(x.dtype)
        h2 = tl.dot(xg, tl.trans(a), h2, input_precision=PRECISION)
    return h0, h1, h2


@triton.jit
def _expand(acc, h0, h1, h2, B, slot, cols, col_ok, r, r_ok, N, S1, S2, scale, stride_bs,
            stride_bn, SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + scale * sum_i h_i @ B_i^T over this program's columns."""
    b = tl.load(B + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_F32:
        b = b.to(tl.float32)
    upd = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    upd = _slice_dot(h0.to(b.dtype), b, cols, 0, S1, upd, PRECISION)
    if SLICES > 1:
        upd = _slice_dot(h1.to(b.dtype), b, cols, S1, S2, upd, PRECISION)
    if SLICES > 2:
        upd = _slice_dot(h2.to(b.dtype), b, cols, S2, N, upd, PRECISION)
    return acc + scale * upd


@triton.jit
def _lora_linear_kernel(X, W, BIAS, OUT, A, B, ORDER, BLOCKS, NUM_BLOCKS, M, N, K, R, scale, S1, S2,
                        stride_xm, stride_wn, stride_om, stride_as, stride_an, stride_bs, stride_bn,
                        HAS_BIAS: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    slot, member, count = _group(ORDER, BLOCKS, 0, rows, BLOCK_M)
    has = count > 0
    r_live = r < tl.where(has, R, 0)
    a_base = A + slot * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    h1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    h2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):   # the weight from HBM, the first slot's A beside it
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        h0, h1, h2 = _shrink_step(x, member, a_base, r, r_live, k, k_ok, R, stride_an, h0, h1, h2,
                                  SLICES, PRECISION)
    if has:
        acc = _expand(acc, h0, h1, h2, B, slot, cols, col_ok, r, r_ok, N, S1, S2, scale, stride_bs,
                      stride_bn, SLICES, BLOCK_M, BLOCK_N, PRECISION, DOT_F32)
    for blk in range(1, NUM_BLOCKS):   # the step's other slots: a pass over K each
        slot, member, count = _group(ORDER, BLOCKS, blk, rows, BLOCK_M)
        if count > 0:
            a_base = A + slot * stride_as
            h0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            h1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            h2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                x = tl.load(X + rows[:, None] * stride_xm + k[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if DOT_F32:
                    x = x.to(tl.float32)
                h0, h1, h2 = _shrink_step(x, member, a_base, r, r_ok, k, k_ok, R, stride_an, h0, h1,
                                          h2, SLICES, PRECISION)
            acc = _expand(acc, h0, h1, h2, B, slot, cols, col_ok, r, r_ok, N, S1, S2, scale,
                          stride_bs, stride_bn, SLICES, BLOCK_M, BLOCK_N, PRECISION, DOT_F32)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta,
                slices: tuple[int, ...], scale: float = 1.0,
                launch: Launch | None = None) -> torch.Tensor:
    """[rows, N]: ``x`` [rows <= MAX_ROWS, K] through ``weight`` [N, K] (+ ``bias``) with the
    LoRA update of each slot's rows (``lora_a`` [slots, S x R, K] and ``lora_b`` [slots, N, R],
    as ``headrace.kernels.triton_lora``'s; ``meta``'s 16-token blocks say the rows of each
    slot). ``launch``: force one (the bench's sweep)."""
    rows, k = x.shape
    n = weight.shape[0]
    pieces = len(slices) - 1
    if rows > MAX_ROWS or slices[0] != 0 or slices[-1] != n or not 1 <= pieces <= MAX_SLICES:
        raise ValueError(f"lora_linear takes at most {MAX_ROWS} rows and whole-row slices "
                         f"(got {rows} rows, slices {slices} of {n} columns)")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    bounds = list(slices) + [slices[-1]] * (MAX_SLICES + 1 - len(slices))
    slots, rank = lora_b.shape[0], lora_b.shape[2]
    blocks = meta.blocks[0]
    num_blocks = min(blocks.shape[0], max_blocks(rows, slots, MAX_ROWS))
    launch = launch or launch_for(n, k, pieces, x.element_size())
    dot_f32 = INTERPRETED and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    _lora_linear_kernel[(cdiv(n, launch.block_n),)](
        x, weight, bias if bias is not None else weight, out, lora_a, lora_b, meta.order, blocks,
        num_blocks, rows, n, k, rank, float(scale), bounds[1], bounds[2], x.stride(0),
        weight.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0),
        lora_b.stride(1), HAS_BIAS=bias is not None, SLICES=pieces, BLOCK_M=MAX_ROWS,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_R=max(16, next_pow2(rank)),
        PRECISION=precision, DOT_F32=dot_f32, num_warps=launch.warps, num_stages=launch.stages)
    return out
