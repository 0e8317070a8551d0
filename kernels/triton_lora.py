"""Triton twins of ``kernels.reference_lora``: the shrink and expand of the batched LoRA update
(Punica's SGMV, as vLLM's ``lora_shrink`` / ``lora_expand``; written here from the semantics).

Why two kernels over tokens grouped by slot: a step mixes adapters, and the work of one
adapter is a skinny GEMM whose weights (a rank-16 A and B) are a few hundred kilobytes; the
tokens of one slot are gathered through ``LoraMeta.order`` so each program reads its slot's
weights once for up to BLOCK_M tokens (a prefill's thousand tokens of one adapter are one
GEMM, a decode batch of eight adapters eight small ones). The grid is static: (token blocks x
column blocks, [slices,] slots), sized by the step's token count (the CUDA graph's bucket) and
the slot count; a program whose slot has fewer tokens than its block's first exits at once, so
a step where no token has an adapter costs only the empty launches (and the CUDA graphs keep a
variant without these kernels for such steps: ``dataplane.lora.batch``).

Shrink: ``buf[k, t, n] = x[t, K_k] @ A[s, n, K_k]^T`` over K split in ``splits`` parts (a decode
of a few tokens would otherwise leave one program per slot to stream A's [S R, K] alone); the
expand sums the ``splits`` partials, so no atomics and no zeroing of ``buf``. Expand: each
program owns BLOCK_N output columns of one slice for BLOCK_M tokens of one slot, reads its
slice's R columns of the summed ``buf`` and the matching [BLOCK_N, R] tile of B, and adds
``scale`` x their product to ``y`` in place (only rows of tokens with a slot are touched).
Accumulation is float32; ``buf`` is float32 and rounded to B's type for the expand's dot (as
vLLM does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host import cdiv, next_pow2
from kernels.reference_lora import LoraMeta
from kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there

MAX_SLICES = 3


@triton.jit
def _shrink_kernel(X, A, BUF, ORDER, COUNTS, STARTS, N, K, K_PER_SPLIT,
                   stride_xm, stride_as, stride_an, stride_bk, stride_bm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    pid, split, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(COUNTS + slot)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(STARTS + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs < count
    rows = tl.load(ORDER + start + offs, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_base = A + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & (k < k_lo + K_PER_SPLIT)
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a = tl.load(a_base + cols[:, None] * stride_an + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        else:
            a = a.to(x.dtype)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    tl.store(BUF + split * stride_bk + rows[:, None] * stride_bm + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_kernel(BUF, B, Y, ORDER, COUNTS, STARTS, R, SPLITS, N_MAX, scale,
                   S0, S1, S2, S3, stride_bk, stride_bm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    pid, piece, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(COUNTS + slot)
    num_n = tl.cdiv(N_MAX, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= count:
        return
    lo = tl.where(piece == 0, S0, tl.where(piece == 1, S1, S2))
    hi = tl.where(piece == 0, S1, tl.where(piece == 1, S2, S3))
    cols = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hi
    if lo + pid_n * BLOCK_N >= hi:
        return
    start = tl.load(STARTS + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs < count
    rows = tl.load(ORDER + start + offs, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k in range(0, SPLITS):
        h += tl.load(BUF + k * stride_bk + rows[:, None] * stride_bm + piece * R + r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(B + slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_F32:
        b = b.to(tl.float32)
    else:
        h = h.to(b.dtype)
    acc = tl.dot(h, tl.trans(b), input_precision=PRECISION)
    out = Y + rows[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + scale * acc).to(Y.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    dot_f32 = INTERPRETED and dtype != torch.float32
    return ("ieee" if dtype == torch.float32 or dot_f32 else "tf32"), dot_f32


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 64 else 64


def _splits(tokens: int, k: int) -> int:
    """K parts of a shrink: a few tokens split K over up to 8 programs (each >= 256 wide)."""
    return 1 if tokens > 64 else max(1, min(8, k // 256))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraMeta,
                buf: torch.Tensor | None = None) -> torch.Tensor:
    """[splits, tokens, S x R] float32 partials (summed by ``lora_expand``); rows of tokens
    without a slot are not written. ``lora_a`` [slots, S x R, K] may be a strided view (its
    rows contiguous)."""
    tokens, k = x.shape
    slots, n = lora_a.shape[0], lora_a.shape[1]
    splits = _splits(tokens, k)
    if buf is None:
        buf = torch.empty((splits, tokens, n), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return buf
    block_m, block_n = _block_m(tokens), min(64, max(16, next_pow2(n)))
    block_k = 64 if x.element_size() >= 4 else 128
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    precision, dot_f32 = _precision(x.dtype)
    grid = (cdiv(tokens, block_m) * cdiv(n, block_n), splits, slots)
    _shrink_kernel[grid](x, lora_a, buf, meta.order, meta.counts, meta.starts, n, k, k_per_split,
                         x.stride(0), lora_a.stride(0), lora_a.stride(1), buf.stride(0), buf.stride(1),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                         DOT_F32=dot_f32, num_warps=4)
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta,
                slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """Adds each slot's tokens' update to ``y`` [tokens, width] in place (see the reference)."""
    tokens = y.shape[0]
    if tokens == 0:
        return y
    pieces = len(slices) - 1
    if not 1 <= pieces <= MAX_SLICES:
        raise ValueError(f"a LoRA projection has 1 to {MAX_SLICES} slices, got {pieces}")
    bounds = list(slices) + [slices[-1]] * (MAX_SLICES + 1 - len(slices))
    widest = max(slices[i + 1] - slices[i] for i in range(pieces))
    slots, rank = lora_b.shape[0], lora_b.shape[2]
    block_m, block_n = _block_m(tokens), 64
    precision, dot_f32 = _precision(lora_b.dtype)
    grid = (cdiv(tokens, block_m) * cdiv(widest, block_n), pieces, slots)
    _expand_kernel[grid](buf, lora_b, y, meta.order, meta.counts, meta.starts, rank, buf.shape[0],
                         widest, float(scale), *bounds, buf.stride(0), buf.stride(1),
                         lora_b.stride(0), lora_b.stride(1), y.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rank)),
                         PRECISION=precision, DOT_F32=dot_f32, num_warps=4)
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoraMeta, slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """Shrink then expand: the whole update of ``y`` in place (one launch each)."""
    return lora_expand(y, lora_shrink(x, lora_a, meta), lora_b, meta, slices, scale)
