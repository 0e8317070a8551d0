"""Triton twins of ``headrace.kernels.reference_lora``: the batched LoRA update of a step whose tokens use
different adapters (Punica's SGMV, as vLLM's ``lora_shrink`` / ``lora_expand``; written here
from the semantics).

Why work lists: the work of one adapter is a skinny GEMM over a few hundred kilobytes of
weights (a rank-16 A and B), and a step mixes adapters. The host cuts each adapter's tokens
(grouped by slot: ``LoraMeta.order``) into blocks and lists them (``LoraMeta.blocks``: slot,
start, tokens), so each program reads its slot's weights once for up to BLOCK_M tokens and the
grid is bounded by the step's token count and the slot count alone (static: the CUDA graphs
replay it with any step's list; unused rows have no tokens and their programs exit at once).

Every step runs a shrink (``buf = x @ A^T`` per block of 64 tokens, float32) and an expand
(``y += buf_i @ B_i^T`` per slice, its columns over programs), each block's A and B read once.
In a step of at most ``FUSED_MAX_TOKENS`` tokens (decodes: the ITL-bound steps) the shrink's
one or two token blocks have one column block (S x R <= 64 columns), so its K is cut over
programs too (``shrink_splits``: one BLOCK_K step each) and their float32 partial sums are added
in order by the expand, which reads them: two short, wide launches. The fused small-step kernel
(``lora_fused``: each column program computes its block's whole ``h`` and adds its columns)
measured slower on an H100 (its column programs each loop over all of K and reread A: 5.7-8.5
µs a Qwen3-0.6B projection at batch 1, 19-38 µs a Llama-3.1-8B one); it stays for
``bench/lora_kernels.py``'s comparison.

A decode's projections take ``headrace.kernels.triton_lora_linear`` instead (the same shrink
and expand inside one launch, with or without the projection's GEMM), which defers to these
kernels above 16 tokens.

Accumulation is float32; ``h`` / ``buf`` is rounded to B's type for the expand's dot (as vLLM
does). ``y`` is updated in place and only rows of tokens with a slot are touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.reference_lora import BLOCK_SIZES, LoraMeta, max_blocks
from headrace.kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there

MAX_SLICES = 3
FUSED_MAX_TOKENS = 64
SHRINK_BLOCK_K = 128      # K elements a shrink program steps (16-bit inputs)
MAX_SHRINK_SPLITS = 32
SMALL, LARGE = BLOCK_SIZES


@triton.jit
def _block(BLOCKS, ORDER, BLOCK_M: tl.constexpr):
    """(slot, rows, row mask, tokens) of block ``program_id(0)`` of the work list."""
    b = tl.program_id(0)
    slot, start, count = tl.load(BLOCKS + 3 * b), tl.load(BLOCKS + 3 * b + 1), tl.load(BLOCKS + 3 * b + 2)
    offs = tl.arange(0, BLOCK_M)
    row_ok = offs < count
    rows = tl.load(ORDER + start + offs, mask=row_ok, other=0).to(tl.int64)
    return slot.to(tl.int64), rows, row_ok, count


@triton.jit
def _slice_dot(h, b, cols, lo, hi, acc, PRECISION: tl.constexpr):
    """acc + h @ B^T over the columns in [lo, hi) (the others' rows of ``b`` zeroed)."""
    mine = (cols >= lo) & (cols < hi)
    return tl.dot(h, tl.trans(tl.where(mine[:, None], b, 0.0).to(h.dtype)), acc,
                  input_precision=PRECISION)


@triton.jit
def _fused_kernel(X, A, B, Y, ORDER, BLOCKS, N, K, R, scale, S1, S2,
                  stride_xm, stride_as, stride_an, stride_bs, stride_bn, stride_ym,
                  SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                  DOT_F32: tl.constexpr):
    slot, rows, row_ok, count = _block(BLOCKS, ORDER, BLOCK_M)
    if count == 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    a_base = A + slot * stride_as
    h0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    h1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    h2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
        mask = r_ok[:, None] & k_ok[None, :]
        a = tl.load(a_base + r[:, None] * stride_an + k[None, :], mask=mask, other=0.0).to(x.dtype)
        h0 = tl.dot(x, tl.trans(a), h0, input_precision=PRECISION)
        if SLICES > 1:
            a = tl.load(a_base + (R + r)[:, None] * stride_an + k[None, :], mask=mask, other=0.0).to(x.dtype)
            h1 = tl.dot(x, tl.trans(a), h1, input_precision=PRECISION)
        if SLICES > 2:
            a = tl.load(a_base + (2 * R + r)[:, None] * stride_an + k[None, :], mask=mask,
                        other=0.0).to(x.dtype)
            h2 = tl.dot(x, tl.trans(a), h2, input_precision=PRECISION)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(B + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_F32:
        b = b.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _slice_dot(h0.to(b.dtype), b, cols, 0, S1, acc, PRECISION)
    if SLICES > 1:
        acc = _slice_dot(h1.to(b.dtype), b, cols, S1, S2, acc, PRECISION)
    if SLICES > 2:
        acc = _slice_dot(h2.to(b.dtype), b, cols, S2, N, acc, PRECISION)
    out = Y + rows[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + scale * acc).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _shrink_kernel(X, A, BUF, ORDER, BLOCKS, N, K, K_PER, stride_xm, stride_as, stride_an, stride_bk,
                   stride_bm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    slot, rows, row_ok, count = _block(BLOCKS, ORDER, BLOCK_M)
    if count == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_base = A + slot * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    split = tl.program_id(2)   # K elements [split x K_PER, + K_PER): its partial sum in buf[split]
    k_end = tl.minimum(K, (split + 1) * K_PER)
    for k0 in range(split * K_PER, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
        a = tl.load(a_base + cols[:, None] * stride_an + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    tl.store(BUF + split.to(tl.int64) * stride_bk + rows[:, None] * stride_bm + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_kernel(BUF, B, Y, ORDER, BLOCKS, R, scale, S0, S1, S2, S3, SPLITS,
                   stride_bk, stride_bm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    slot, rows, row_ok, count = _block(BLOCKS, ORDER, BLOCK_M)
    if count == 0:
        return
    piece = tl.program_id(2)
    lo = tl.where(piece == 0, S0, tl.where(piece == 1, S1, S2))
    hi = tl.where(piece == 0, S1, tl.where(piece == 1, S2, S3))
    first = lo + tl.program_id(1) * BLOCK_N
    if first >= hi:
        return
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < hi
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    h_at = BUF + rows[:, None] * stride_bm + piece * R + r[None, :]
    h_ok = row_ok[:, None] & r_ok[None, :]
    h = tl.load(h_at, mask=h_ok, other=0.0)
    for s in range(1, SPLITS):   # the shrink's K partial sums, in order
        h += tl.load(h_at + s * stride_bk, mask=h_ok, other=0.0)
    b = tl.load(B + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
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


def _grid_blocks(meta: LoraMeta, tokens: int, slots: int, size: int) -> tuple[torch.Tensor, int]:
    blocks = meta.blocks[BLOCK_SIZES.index(size)]
    return blocks, min(blocks.shape[0], max_blocks(tokens, slots, size))


def shrink_splits(tokens: int, k: int) -> int:
    """How many programs share a token block's K in the shrink: a step of at most
    ``FUSED_MAX_TOKENS`` tokens (a decode) has one or two token blocks and one column block
    (S x R <= 64 columns), so its K is cut into one BLOCK_K step a program (at most
    ``MAX_SHRINK_SPLITS``) instead of one program looping over all of it; larger steps have
    programs enough."""
    return min(MAX_SHRINK_SPLITS, cdiv(k, SHRINK_BLOCK_K)) if tokens <= FUSED_MAX_TOKENS else 1


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraMeta,
                buf: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """[splits, tokens, S x R] float32 partial sums over K (the reference's layout when
    ``splits`` is 1; the expand adds them in order): each slot's tokens' ``x @ A^T``; rows of
    tokens without a slot are not written. ``lora_a`` [slots, S x R, K] may be a strided view
    (its rows contiguous); a given ``buf`` sets the split count."""
    tokens, k = x.shape
    slots, n = lora_a.shape[0], lora_a.shape[1]
    block_k = 64 if x.element_size() >= 4 else SHRINK_BLOCK_K
    splits = buf.shape[0] if buf is not None else splits or shrink_splits(tokens, k)
    k_per = cdiv(cdiv(k, splits), block_k) * block_k
    if buf is None:   # (a given buffer's programs past K store zeros)
        splits = max(1, cdiv(k, k_per))
        buf = torch.empty((splits, tokens, n), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return buf
    blocks, num = _grid_blocks(meta, tokens, slots, LARGE)
    block_n = min(64, max(16, next_pow2(n)))
    precision, dot_f32 = _precision(x.dtype)
    _shrink_kernel[(num, cdiv(n, block_n), splits)](
        x, lora_a, buf, meta.order, blocks, n, k, k_per, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), buf.stride(0), buf.stride(1), BLOCK_M=LARGE, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=precision, DOT_F32=dot_f32, num_warps=4)
    return buf


def _bounds(slices: tuple[int, ...]) -> list[int]:
    pieces = len(slices) - 1
    if not 1 <= pieces <= MAX_SLICES:
        raise ValueError(f"a LoRA projection has 1 to {MAX_SLICES} slices, got {pieces}")
    return list(slices) + [slices[-1]] * (MAX_SLICES + 1 - len(slices))


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta,
                slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """Adds each slot's tokens' update to ``y`` [tokens, width] in place (``buf``: the
    shrink's partial sums, added here in order)."""
    tokens = y.shape[0]
    if tokens == 0:
        return y
    bounds = _bounds(slices)
    widest = max(bounds[i + 1] - bounds[i] for i in range(len(slices) - 1))
    slots, rank = lora_b.shape[0], lora_b.shape[2]
    blocks, num = _grid_blocks(meta, tokens, slots, LARGE)
    precision, dot_f32 = _precision(lora_b.dtype)
    _expand_kernel[(num, cdiv(widest, 64), len(slices) - 1)](
        buf, lora_b, y, meta.order, blocks, rank, float(scale), *bounds, buf.shape[0], buf.stride(0),
        buf.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=LARGE, BLOCK_N=64,
        BLOCK_R=max(16, next_pow2(rank)), PRECISION=precision, DOT_F32=dot_f32, num_warps=4)
    return y


def lora_fused(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               meta: LoraMeta, slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """The whole update in one launch (the small-step kernel before session 28: see the
    module doc; ``bench/lora_kernels.py`` times it beside the served path)."""
    tokens, k = x.shape
    bounds = _bounds(slices)
    slots, rank, n = lora_b.shape[0], lora_b.shape[2], slices[-1] - slices[0]
    if slices[0] != 0:
        raise ValueError("the fused LoRA kernel updates whole rows (slices from 0)")
    blocks, num = _grid_blocks(meta, tokens, slots, SMALL)
    block_n = 128 if n >= 2048 else 64
    precision, dot_f32 = _precision(x.dtype)
    _fused_kernel[(num, cdiv(n, block_n))](
        x, lora_a, lora_b, y, meta.order, blocks, n, k, rank, float(scale), bounds[1], bounds[2],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), SLICES=len(slices) - 1, BLOCK_M=SMALL, BLOCK_N=block_n,
        BLOCK_K=64 if x.element_size() >= 4 else 128, BLOCK_R=max(16, next_pow2(rank)),
        PRECISION=precision, DOT_F32=dot_f32, num_warps=4)
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoraMeta, slices: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """The whole update of ``y`` in place: a shrink (its K split over programs for a step of
    at most ``FUSED_MAX_TOKENS`` tokens) and an expand."""
    if y.shape[0] == 0:
        return y
    return lora_expand(y, lora_shrink(x, lora_a, meta), lora_b, meta, slices, scale)
