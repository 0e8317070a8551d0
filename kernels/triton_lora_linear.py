"""A decode's projection and its LoRA update in one launch: ``y = x @ W^T (+ bias)``, then each
token's ``scale * (x @ A_i^T) @ B_i^T`` of its slot (``headrace.kernels.reference_lora.lora_linear``),
for steps of at most ``MAX_ROWS`` tokens.

Why one launch: at batch 1-16 a projection is a few microseconds of weight reading, and every
kernel a CUDA graph replays costs ~2 µs of dependent latency whatever it does. The separate
update (``headrace.kernels.triton_lora``: a shrink, then an expand) adds two such nodes to each
projection, 8 a layer: on Qwen3-0.6B about as much time as the projections themselves. Doing the
update inside each column program of the projection (session 28's attempt) made every one of
them reread A over all of K: slower still.

So the launch has two kinds of programs. The first ``blocks x splits`` programs are the shrink:
each computes one token block's (one slot's) ``x @ A^T`` over one slice of K, stores the
float32 partial sum and counts itself done (a release). The others are the skinny GEMM of
``headrace.kernels.triton_linear`` (each owns BLOCK_N output columns for every row and streams
its weight slice), which after their K loop wait until every shrink program is counted (an
acquire; by then the shrink, started first with the lowest program ids, has long finished: it
reads a few hundred kilobytes while a column program reads its weight), add the partial sums in
order and apply their columns' B. The last column program resets the counters, so they are zero
again when the kernel ends (no memset node). The shrink programs have the lowest ids, which the
hardware starts first, so a waiting column program never holds up one it waits for.

Where the projection is torch's GEMM (a large weight: Llama-3.1-8B's) or quantized,
``lora_update`` runs the same launch without the GEMM: its column programs read the
projection's output and add the update in place, one node instead of the shrink's and the
expand's two.

Bits: the shrink's K slices, their order and the roundings are those of ``triton_lora``'s small
steps, and the projection is rounded to the weight's type before the update is added, as
``triton_linear.linear`` followed by ``triton_lora.lora_add`` does: the same output, bit for
bit (where ``triton_linear`` runs its own kernel, not torch's). Where the launch does not apply
(more than ``MAX_ROWS`` tokens, a rank over ``MAX_SHRINK_COLUMNS``, slices off the column tile),
the separate launches run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from headrace.kernels import triton_linear, triton_lora
from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.reference_lora import BLOCK_SIZES, LoraMeta, max_blocks
from headrace.kernels.triton_flash import INTERPRETED

MAX_ROWS = triton_linear.MAX_ROWS    # 16: one token block of BLOCK_SIZES[0]
MAX_SHRINK_COLUMNS = 256             # S x R of the slot buffers (3 slices of rank 64 and below)
SMALL = BLOCK_SIZES[0]
assert SMALL == MAX_ROWS
# A small weight with a long K (Qwen3-0.6B's down_proj, 1024 x 3072) runs torch's GEMM in
# ``triton_linear`` (measured faster there alone); with its update, the one launch saves two
# graph nodes (~4-5 µs) against a skinny GEMM of at most a few µs more (a prediction: the
# ``one_launch_us`` column of bench/lora_kernels.py says). Large weights (8B) keep torch's.
LONG_K_ELEMENTS = 8 << 20
LONG_K_TILE = (16, 256, 3)
UPDATE_BLOCK_N = 64   # the update alone (``lora_update``): output columns a program
# A's elements a shrink program loads a step (SHRINK_N columns x SHRINK_K of K, within
# triton_lora's 128-element K slices: the MMA adds 16-element K chunks in order either way).
# The kernel's registers are the larger of its two programs' needs: a 64 x 128 step took 247
# a thread (sm_90, ptxas), two CTAs an SM, against the skinny GEMM's ~95; 64 x 32 takes ~125.
SHRINK_TILE = 2048
# HEADRACE_LORA_ONE_LAUNCH=0: always the three launches (benchmarks' same-run baseline)
ONE_LAUNCH = os.environ.get("HEADRACE_LORA_ONE_LAUNCH", "1") != "0"


@triton.jit
def _lora_linear_kernel(X, W, BIAS, OUT, A, B, BUF, SYNC, ORDER, BLOCKS,
                        M, N, K, R, SR, scale, S1, S2, K_PER, NUM_SHRINK, NUM_COLS, NUM_LIST,
                        stride_xm, stride_wn, stride_om, stride_as, stride_an, stride_bs, stride_bn,
                        stride_bk, stride_bm, SPLITS,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SHRINK_N: tl.constexpr, SHRINK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                        PROJECT: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_M)
    if pid < NUM_SHRINK:   # -- the shrink: one token block, one K slice ------------------------
        blk, split = pid // SPLITS, pid % SPLITS
        slot = tl.load(BLOCKS + 3 * blk).to(tl.int64)
        start, count = tl.load(BLOCKS + 3 * blk + 1), tl.load(BLOCKS + 3 * blk + 2)
        if count > 0:
            row_ok = offs < count
            rows = tl.load(ORDER + start + offs, mask=row_ok, other=0).to(tl.int64)
            cols = tl.arange(0, SHRINK_N)
            col_ok = cols < SR
            acc = tl.zeros([BLOCK_M, SHRINK_N], dtype=tl.float32)
            k_end = tl.minimum(K, (split + 1) * K_PER)
            for k0 in range(split * K_PER, k_end, SHRINK_K):
                k = k0 + tl.arange(0, SHRINK_K)
                k_ok = k < k_end
                x = tl.load(X + rows[:, None] * stride_xm + k[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if DOT_F32:
                    x = x.to(tl.float32)
                a = tl.load(A + slot * stride_as + cols[:, None] * stride_an + k[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
            tl.store(BUF + split.to(tl.int64) * stride_bk + rows[:, None] * stride_bm + cols[None, :],
                     acc, mask=row_ok[:, None] & col_ok[None, :])
        tl.atomic_add(SYNC, 1, sem="release")   # (every shrink program counts, empty or not)
    else:   # -- a column block of the projection (PROJECT), then its update ------------------------
        cols = (pid - NUM_SHRINK) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = offs < M, cols < N
        if PROJECT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):   # (triton_linear's loop: the same sums)
                k = k0 + tl.arange(0, BLOCK_K)[None, :]
                x = tl.load(X + offs[:, None] * stride_xm + k, mask=row_ok[:, None] & (k < K), other=0.0)
                w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k,
                            mask=col_ok[:, None] & (k < K), other=0.0)
                if DOT_F32:
                    x, w = x.to(tl.float32), w.to(tl.float32)
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if HAS_BIAS:
                acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y = acc.to(OUT.dtype.element_ty).to(tl.float32)   # (rounded, as the separate path stores it)
        else:   # the projection's output is OUT already (updated in place)
            y = tl.load(OUT + offs[:, None] * stride_om + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        while tl.atomic_add(SYNC, 0, sem="acquire") < NUM_SHRINK:
            pass
        first = (pid - NUM_SHRINK) * BLOCK_N   # this block's slice (the slices align to BLOCK_N)
        piece = (first >= S1).to(tl.int32) + (first >= S2).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        h_at = BUF + offs[:, None] * stride_bm + piece * R + r[None, :]
        h_ok = row_ok[:, None] & r_ok[None, :]
        h = tl.load(h_at, mask=h_ok, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLITS):   # the partial sums, in order
            h += tl.load(h_at + s * stride_bk, mask=h_ok, other=0.0, cache_modifier=".cg")
        update = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        used = tl.zeros([BLOCK_M], dtype=tl.int32)   # rows of a token with a slot
        for blk in range(NUM_LIST):   # each slot's tokens: their rows of h through its B
            count = tl.load(BLOCKS + 3 * blk + 2)
            if count > 0:
                slot = tl.load(BLOCKS + 3 * blk).to(tl.int64)
                start = tl.load(BLOCKS + 3 * blk + 1)
                tokens = tl.load(ORDER + start + offs, mask=offs < count, other=-1)
                mine = tl.max((offs[:, None] == tokens[None, :]).to(tl.int32), axis=1)
                b = tl.load(B + slot * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
                            mask=col_ok[:, None] & r_ok[None, :], other=0.0)
                hm = tl.where(mine[:, None] > 0, h, 0.0)
                if DOT_F32:
                    b = b.to(tl.float32)
                else:
                    hm = hm.to(b.dtype)
                part = tl.dot(hm, tl.trans(b), input_precision=PRECISION)
                update += tl.where(mine[:, None] > 0, part, 0.0)
                used += mine
        out = tl.where((used > 0)[:, None], y + scale * update, y)
        tl.store(OUT + offs[:, None] * stride_om + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        done = tl.atomic_add(SYNC + 1, 1, sem="acq_rel")
        if done == NUM_COLS - 1:   # the last program: the counters back to zero for the next launch
            tl.atomic_xchg(SYNC, 0)
            tl.atomic_xchg(SYNC + 1, 0)


def _fits(rows: int, n: int, lora_a: torch.Tensor, slices: tuple[int, ...], block_n: int) -> bool:
    return ONE_LAUNCH and 0 < rows <= MAX_ROWS and lora_a.shape[1] <= MAX_SHRINK_COLUMNS \
        and slices[0] == 0 and slices[-1] == n and len(slices) - 1 <= triton_lora.MAX_SLICES \
        and not any(b % block_n for b in slices)


def plan(rows: int, weight: torch.Tensor, lora_a: torch.Tensor, slices: tuple[int, ...]):
    """The launch (BLOCK_N, BLOCK_K, stages) of the projection with its update for an input of
    ``rows`` rows, or None where the skinny GEMM does not apply (torch's GEMM, then
    ``lora_update``)."""
    n, k = weight.shape
    tiles = triton_linear._tiles(n, k)
    if tiles is None and n * k <= LONG_K_ELEMENTS:   # (see LONG_K_ELEMENTS)
        tiles = LONG_K_TILE
    return tiles if tiles is not None and _fits(rows, n, lora_a, slices, tiles[0]) else None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, meta: LoraMeta, slices: tuple[int, ...],
                sync: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` with each slot's tokens' LoRA update (``meta``), x [tokens, K];
    ``sync``: two int32 zeros on the device, the call site's own (the kernel leaves them zero;
    None: fresh ones). One launch where ``plan`` allows, else the projection then
    ``lora_update``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    launch = plan(x.shape[0], weight, lora_a, slices) if x.dtype == weight.dtype else None
    if launch is None:
        y = triton_linear.linear(x, weight, bias)
        return lora_update(y if y.is_contiguous() else y.contiguous(), x, lora_a, lora_b, meta, slices,
                           sync, scale)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(out, x, weight, bias, lora_a, lora_b, meta, slices, sync, scale, *launch)


def lora_update(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                meta: LoraMeta, slices: tuple[int, ...], sync: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
    """``triton_lora.lora_add`` (y [tokens, N] updated in place), its shrink and expand in one
    launch for a decode (``sync`` as in ``lora_linear``): the update of a projection whose
    GEMM is torch's (large weights) or quantized."""
    if not _fits(y.shape[0], y.shape[1], lora_a, slices, UPDATE_BLOCK_N):
        return triton_lora.lora_add(y, x, lora_a, lora_b, meta, slices, scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _launch(y, x, None, None, lora_a, lora_b, meta, slices, sync, scale, UPDATE_BLOCK_N, 16, 1)


def _launch(out, x, weight, bias, lora_a, lora_b, meta, slices, sync, scale, block_n, block_k, stages):
    rows, k = x.shape
    n, slots, rank = out.shape[1], lora_a.shape[0], lora_b.shape[2]
    splits = triton_lora.shrink_splits(rows, k)   # (triton_lora's K slices: the same sums)
    slice_k = 64 if x.element_size() >= 4 else triton_lora.SHRINK_BLOCK_K
    k_per = cdiv(cdiv(k, splits), slice_k) * slice_k
    splits = max(1, cdiv(k, k_per))
    shrink_n = max(16, next_pow2(lora_a.shape[1]))
    blocks = meta.blocks[0]
    num_list = min(blocks.shape[0], max_blocks(rows, slots, SMALL))
    if sync is None:
        sync = torch.zeros(2, dtype=torch.int32, device=x.device)
    buf = torch.empty((splits, rows, lora_a.shape[1]), dtype=torch.float32, device=x.device)
    num_cols = cdiv(n, block_n)
    dot_f32 = INTERPRETED and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    project = weight is not None
    _lora_linear_kernel[(num_list * splits + num_cols,)](
        x, weight if project else x, bias if bias is not None else x, out, lora_a, lora_b, buf, sync,
        meta.order, blocks, rows, n, k, rank, lora_a.shape[1], float(scale),
        slices[1] if len(slices) > 2 else n, slices[2] if len(slices) > 3 else n, k_per,
        num_list * splits, num_cols, num_list, x.stride(0), weight.stride(0) if project else 0,
        out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        buf.stride(0), buf.stride(1), splits, HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k if x.element_size() <= 2 else 128,
        SHRINK_N=shrink_n, SHRINK_K=max(16, SHRINK_TILE // shrink_n), BLOCK_R=max(16, next_pow2(rank)),
        PRECISION=precision, DOT_F32=dot_f32, PROJECT=project, num_warps=4, num_stages=stages)
    return out
