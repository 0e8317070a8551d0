"""Triton skinny GEMM for 4- and 8-bit integer weights at decode batch sizes (W4A16 / W8A16,
``headrace.kernels.reference_quant.wna16_linear`` with contiguous groups of a multiple of 128
columns, or one group per output channel).

Why: a decode projection is bound by its weight bytes, and INT4 reads a quarter of bf16's, but
``headrace.kernels.triton_quant``'s general kernel (tiles for prefill: dequantise a [BLOCK_K,
BLOCK_N] tile to the activation dtype, then tl.dot) read them at 0.3-1.1 TB/s on the H200 (issue
21). This kernel keeps the GPTQ layout (``qweight`` [K / P, N] int32, P = 32 / bits values of K per
word, 16-byte loads along N) and does the least work per weight byte:

* a K tile lies inside one group (the group size is a multiple of BLOCK_K = 128), so the
  scale applies once per tile and column, in float32 (more exact than the reference, which
  rounds each dequantised weight to x's dtype);
* FMA programs (M <= 4, and 8-bit tl.dot) fold zero points out of the inner loop:
  sum_k x_k (q_kn - z_n) = sum_k x_k q_kn - z_n sum_k x_k, and value j of every word in the
  tile multiplies x at k = P * word + j (a strided load of x, which stays in L1), so words are
  never reshaped across threads. They accumulate w * x element-wise over the words of the tile
  and reduce across threads once per tile; at one row the pipelined FMA program (``Tile.pipe``,
  ``_fma_pipelined``) holds 2-D tiles only, issues the next tile's words before it multiplies
  the current ones and turns values into floats without conversion instructions;
* tl.dot programs compute acc^T = Q [BLOCK_N, K] @ X^T with the unpacked values as the MMA's
  A operand, so the weight fills the tensor core's wide side and the tokens its narrow side
  (16 rows at least: one row pads to 16 for free, the MMA's work being no bound here). 4-bit
  words unpack by magic numbers (``headrace.kernels.triton_int4_operand``: two values a shift and an
  and-or, no int-to-float conversion), their zero points are subtracted exactly in x's dtype,
  and x streams by the pipeline's async copies: 332 warp instructions a 4 KB step of the
  16 x 64 tile on SM90 where the strided, converting version took 670, 350 a 2 KB step of
  the 16 x 32 tile (``python -m bench.gemm_sass``); the loops load without masks where the
  shapes allow (``EVEN_K``, ``EVEN_N``; rows past M read the last row).

The launch tile per row bucket and shape is pinned by the measured table or computed
(``headrace.kernels.skinny_gemm``; autotuned only with HEADRACE_QUANT_AUTOTUNE=1); K is split over
programs with the self-cleaning workspace where output tiles are few. No host synchronisation:
CUDA-graph safe.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv
from headrace.kernels.skinny_gemm import (MAX_SPLIT, PROGRAMS_PER_SM, Tile, Tuner, activations,
                                          launch_args, program_slice, store_or_reduce)
from headrace.kernels.triton_int4_operand import dot_step_int4
from headrace.kernels.triton_int4_packed import fma_pipelined_packed
from headrace.kernels.triton_flash import INTERPRETED

# The PTX unpacking (``triton_int4_operand.unpack_int4_bf16_asm``) instead of the Triton one,
# for bfloat16 activations: off until the H200 measures it faster (the interpreter cannot run
# PTX)
UNPACK_ASM = not INTERPRETED and os.environ.get("HEADRACE_W4A16_ASM") == "1"
PACKED = not INTERPRETED   # the one-row program on bfloat16 pairs (headrace.kernels.triton_int4_packed)
BLOCK_K = 128          # K values per step: one group of the common 128, 64 bytes of int4 a column


@triton.jit(do_not_specialize=["M_BUCKET", "GROUP"])
def _w4a16_skinny_kernel(X, QW, S, Z, B, OUT, WS, CNT, M, N, K, GROUP, stride_xm, stride_om,
                         M_BUCKET, SPLIT_K, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_DOT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                         PIPE: tl.constexpr = False, ASM: tl.constexpr = False,
                         EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
                         PACKED: tl.constexpr = False):
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PER                 # packed words of K per step
    rows, cols, k_lo, k_hi = program_slice(K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    # rows and columns past the output read the last ones (never stored): the loop's loads need
    # no masks but K's, none when K is whole steps (EVEN_K), so no predicates or selects a step.
    # Columns are clamped only where N is not whole tiles: a clamp hides their contiguity from
    # the compiler, whose loads then go one word at a time.
    rows_in = tl.minimum(rows, M - 1)
    cols_in = cols if EVEN_N else tl.minimum(cols, N - 1)
    dtype = X.dtype.element_ty
    x_rows = X + rows_in.to(tl.int64) * stride_xm
    if PIPE and not USE_DOT:      # one row a program (grid: M programs, each row exists)
        tl.static_assert(BLOCK_M == 1)
        if PACKED:      # 4-bit words, bfloat16 x, on the GPU: two values an instruction
            acc = fma_pipelined_packed(x_rows, QW, S, Z, cols_in, N, K, GROUP, k_lo, k_hi,
                                       BLOCK_N, BLOCK_K, EVEN_K)
        else:
            acc = _fma_pipelined(x_rows, QW, S, Z, cols_in, N, K, GROUP, k_lo, k_hi, BITS,
                                 BLOCK_N, BLOCK_K, EVEN_K)
        store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, 0, B,
                        HAS_BIAS, SPLIT_K, False)
        return
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # the weight's pointers advance a step at a time (computing them from k0 took 32 more
    # instructions a step at 16 x 32; x's did better computed: 12 fewer)
    w_at = QW + (k_lo // PER + tl.arange(0, KW))[None, :].to(tl.int64) * N + cols_in[:, None]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kw = k0 // PER + tl.arange(0, KW)
        if EVEN_K:
            words = tl.load(w_at)
        else:
            words = tl.load(w_at, mask=(kw < K // PER)[None, :], other=0)
        w_at += KW * N
        g = k0 // GROUP
        s = tl.load(S + g * N + cols_in).to(tl.float32)
        z = tl.load(Z + g * N + cols_in).to(tl.float32)
        if USE_DOT and BITS == 4:
            xk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xt = tl.load(x_rows[None, :] + xk[:, None])                           # [BK, BM]
            else:
                xt = tl.load(x_rows[None, :] + xk[:, None], mask=(xk < K)[:, None], other=0.0)
            t = dot_step_int4(words, z, xt, BLOCK_N, BLOCK_K, PRECISION, DOT_F32, ASM)
            # zero points already subtracted: the fold below is constant zero, compiled away
            xsum, z = tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros_like(z)
        elif USE_DOT:
            t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(PER):
                xk = kw * PER + j
                xt = tl.load(x_rows[None, :] + xk[:, None],
                             mask=(xk < K)[:, None], other=0.0)                    # [KW, BM]
                q = (words >> (j * BITS)) & ((1 << BITS) - 1)
                xsum += tl.sum(xt.to(tl.float32), axis=0)
                if DOT_F32:
                    q, xt = q.to(tl.float32), xt.to(tl.float32)
                else:
                    q = q.to(dtype)                                           # exact
                t = tl.dot(q, xt, t, input_precision=PRECISION)
        else:
            t3 = tl.zeros([BLOCK_N, BLOCK_M, KW], dtype=tl.float32)
            x3 = tl.zeros([BLOCK_M, KW], dtype=tl.float32)
            for j in tl.static_range(PER):
                xk = kw * PER + j
                x = tl.load(x_rows[:, None] + xk[None, :], mask=(xk < K)[None, :],
                            other=0.0).to(tl.float32)                         # [BM, KW]
                q = ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
                t3 += q[:, None, :] * x[None, :, :]
                x3 += x
            t = tl.sum(t3, axis=2)
            xsum = tl.sum(x3, axis=1)
        acc += s[:, None] * (t - z[:, None] * xsum[None, :])
    # scales are applied per tile above: the epilogue's scale is one
    store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, 0, B, HAS_BIAS,
                    SPLIT_K, False)


@triton.jit
def _fma_pipelined(x_row, QW, S, Z, cols, N, K, GROUP, k_lo, k_hi, BITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, 1] of the row at ``x_row`` over the K slice [k_lo, k_hi) on the CUDA cores,
    2-D tiles [KW words of K, BLOCK_N columns] only (as ``triton_fp8_linear._fma_pipelined``:
    the next tile's words are loaded before the current one is multiplied, products add up
    element-wise, one reduction across threads at the end). ``cols`` are inside N.

    A value becomes float32 without a conversion instruction (int-to-float converts at a
    quarter of the FMA rate): shifted to the mantissa's top bits and OR 1.0's bits, it is the
    float v = 1 + q / 2^BITS, exact, and sum_k x (q - z) = 2^BITS sum_k x v - (2^BITS + z)
    sum_k x, the sum of x taken per row of the tile and step (shared by its columns): a value
    costs a shift, one and-or (LOP3) and an FMA. 1.0's bits come from a runtime value, since
    a LOP3 takes one immediate: with both constants the compiler issued an and and an or. (The
    float 2^23 + q, with q in the mantissa's low bits, needed a subtraction of 2^23 + z a value,
    and the compiler took its low-bit mask as a sign-extend: 5 instructions a value, 465 a step
    of 4 warps at 64 columns against 335 now, Triton 3.6's SM90 code.) The group's scale
    multiplies each tile's sums. Precision: the cancellation leaves float32's rounding of
    sum_k x v times 2^BITS, ~1e-6 (4-bit) and ~2e-5 (8-bit) of sum_k |x|.

    x is loaded as a 1-D [KW] vector and expanded: the compiler loads it in the words' row
    layout, once per row a thread holds. A [KW, 1] load was issued once per column a thread
    holds (4x over), and a [KW, BLOCK_N] broadcast load took a trip through shared memory per
    value of a word. The next tile's start is clamped to the slice's last tile (loaded twice at
    the end) rather than masked, and with K in whole steps (EVEN_K) no load is masked."""
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    MANTISSA_TOP: tl.constexpr = 23 - BITS       # a value's place among float32's mantissa bits
    c = cols[None, :]
    kw_hi = k_hi // PER
    # the first word of the slice's first and last steps (both inside K: an empty slice, past
    # K, loads the last step and adds nothing)
    k_end = (K - 1) // BLOCK_K * BLOCK_K
    first = tl.minimum(k_lo, k_end)
    last = tl.minimum(k_lo + tl.maximum(k_hi - k_lo - 1, 0) // BLOCK_K * BLOCK_K, k_end) // PER
    rk = tl.arange(0, KW)[:, None]                                                  # [KW, 1]
    tile_at = QW + rk.to(tl.int64) * N + c             # a tile's words, less its first row's
    if EVEN_K:
        words = tl.load(tile_at + (first // PER).to(tl.int64) * N)
    else:
        words = tl.load(tile_at + (first // PER).to(tl.int64) * N,
                        mask=first // PER + rk < kw_hi, other=0)
    acc = tl.zeros([KW, BLOCK_N], dtype=tl.float32)
    one = (GROUP > 0).to(tl.uint32) * 0x3F800000         # 1.0's bits, unknown to the compiler
    for k0 in range(k_lo, k_hi, BLOCK_K):
        nxt = tl.minimum(k0 // PER + KW, last)
        if EVEN_K:
            words_next = tl.load(tile_at + nxt.to(tl.int64) * N)
        else:
            words_next = tl.load(tile_at + nxt.to(tl.int64) * N, mask=nxt + rk < kw_hi, other=0)
        g = k0 // GROUP
        s = tl.load(S + g * N + cols).to(tl.float32)[None, :]                        # [1, BN]
        z = tl.load(Z + g * N + cols).to(tl.float32)[None, :]
        u = words.to(tl.uint32, bitcast=True)      # shifted in as zeros
        t = tl.zeros([KW, BLOCK_N], dtype=tl.float32)
        xs = tl.zeros([KW], dtype=tl.float32)
        for j in tl.static_range(PER):
            xk1 = k0 + tl.arange(0, KW) * PER + j                                    # [KW]
            if EVEN_K:
                x = tl.load(x_row + xk1).to(tl.float32)
            else:
                x = tl.load(x_row + xk1, mask=xk1 < k_hi, other=0.0).to(tl.float32)
            xs += x
            # value j's bits moved to the mantissa's top: the float 1 + q / 2^BITS
            at = MANTISSA_TOP - BITS * j
            if at >= 0:
                f = u << at
            else:
                f = u >> -at
            v = ((f & (MASK << MANTISSA_TOP)) | one).to(tl.float32, bitcast=True)
            t += v * x[:, None]
        # sum_k x (q - z) = 2^BITS sum_k x v - (2^BITS + z) sum_k x, per row of the tile
        acc += s * (t * (MASK + 1.0) - (z + (MASK + 1.0)) * xs[:, None])
        words = words_next
    return tl.sum(acc, axis=0)[:, None]


def _pipe(n: int, warps: int = 4, split: int = 1, stages: int = 1) -> Tile:
    return Tile(1, n, BLOCK_K, warps, stages, split, dot=False, pipe=True)


def _fma(m: int, n: int, warps: int = 4, split: int = 1) -> Tile:
    return Tile(m, n, BLOCK_K, warps, 3, split, dot=False)


def _dot(m: int, n: int, warps: int = 4, split: int = 1, stages: int = 3) -> Tile:
    return Tile(m, n, BLOCK_K, warps, stages, split)


# Candidate tiles per row bucket: the first (unsplit) one is the fixed choice (K split by
# skinny_gemm.split_for) and the interpreter's; the rest are the sweep's and autotuner's. At
# one row only the pipelined program's tiles (on the H200 the FMA and dot tiles took 13.7-203
# us where its best took 8.1-28.7, session 26); 2-warp tiles of 32 columns split 4-16 ways
# were first or within 3% of it for every shape in an A/B sweep (o 7.7 against 8.1 us).
# From 2 to 16 rows the 4-bit dot program runs 32 columns a program on 2 warps (its cost
# hardly depends on its rows up to 16: its weight bytes bound it); 64 columns on 2 warps (0.29
# instructions a weight byte against 0.34, x read half as often) measured level with it
# (session 23) and stay candidates. Below the 64 rows of Hopper's wgmma, Triton takes the
# Ampere MMA, whose operand staging has few shared-memory bank conflicts; the wgmma tiles' staging of the unpacked weight conflicted 8 ways (H200, session
# 22: qkv at M = 16 in 15.5 us against 26.1 for 16 x 64 on 4 warps; ncu: 70% of shared-memory
# wavefronts excessive there, 26% at 16 x 32 on 4 warps).
TILES = {
    1: [_pipe(64), _pipe(64, 4, 8), _pipe(32, 4, 4), _pipe(32, 4, 8), _pipe(64, 4, 16),
        _pipe(32, 2, 8), _pipe(128, 4, 8), _pipe(64, 2, 8), _pipe(32, 4, 16), _pipe(64, 4, 4, 2),
        _pipe(32, 2, 16), _pipe(32, 2, 4), _pipe(64, 2, 16), _pipe(64, 2, 4), _pipe(32, 1, 8),
        _pipe(32, 1, 16)],
    2: [_dot(16, 32, 2), _fma(2, 128), _fma(2, 64), _fma(2, 256, 8), _fma(2, 128, 4, 2),
        _dot(16, 128), _dot(16, 64, 4, 4), _dot(16, 128, 4, 4), _dot(16, 32, 2, 4)],
    4: [_dot(16, 32, 2), _dot(16, 128), _fma(4, 64), _fma(4, 128, 8), _dot(16, 64),
        _dot(16, 128, 4, 2), _dot(16, 32, 2, 4)],
    8: [_dot(16, 32, 2), _dot(16, 32, 2, 8), _dot(16, 32, 2, 4), _dot(16, 32, 1, 8),
        _dot(16, 64, 2, 4), _dot(16, 64, 2, 8), _dot(16, 64, 2, 4, 4), _dot(16, 32, 4, 4),
        _dot(16, 128), _dot(16, 64), _dot(16, 128, 4, 2), _dot(16, 64, 4, 4), _dot(16, 128, 4, 4),
        _dot(16, 64, 4, 2), _dot(16, 64, 4, 4, 4)],
    32: [_dot(32, 128), _dot(32, 64), _dot(32, 256, 8), _dot(32, 128, 4, 2), _dot(32, 128, 8),
         _dot(32, 128, 4, 4), _dot(32, 64, 4, 2), _dot(32, 64, 4, 4), _dot(32, 32, 2, 4),
         _dot(32, 32, 2, 8)],
    64: [_dot(64, 128), _dot(64, 64), _dot(64, 128, 8), _dot(64, 256, 8), _dot(64, 128, 4, 2),
         _dot(64, 64, 4, 2), _dot(64, 128, 4, 4), _dot(64, 64, 4, 4), _dot(64, 32, 2, 4),
         _dot(64, 32, 4, 4)],
    128: [_dot(128, 128, 8), _dot(64, 128), _dot(128, 64), _dot(64, 128, 8, 2)],
}
TILES[16] = TILES[8]
TILES[256] = TILES[128]
if INTERPRETED:
    TILES = {b: ts[:1] for b, ts in TILES.items()}

# The fixed one-row tile (64 columns, 4 KB of INT4 a step) splits K up to 16 ways while its
# programs are fewer than 8 an SM: it is issue-bound (session 23) and wants many programs. On
# the H200 (session 24's sweep) Llama-3.1-8B's qkv / o / gate_up / down ran in 12.3 / 9.1 /
# ~34 / 20.1 us so (split 16 / 16 / 4 / 16), within 11% of each shape's best tile, where the
# rule of the other tiles (4 programs an SM, 4 slices at most) gave 14.7 / 13.9 / 35.1 / 39.5.
PIPE_SPLIT_LIMITS = (8, 16)
TUNER = Tuner(triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0})(
    _w4a16_skinny_kernel), TILES, fits=lambda tile, args: tile.block_k == BLOCK_K,
    split_limits=lambda tile: PIPE_SPLIT_LIMITS if tile.pipe else (PROGRAMS_PER_SM, MAX_SPLIT))


def _packed(x2: torch.Tensor, bits: int) -> bool:
    """Whether the one-row program runs on packed bfloat16 pairs (``kernels.
    triton_int4_packed``: PTX, so compiled kernels only; x's rows read as 32-bit words)."""
    return (PACKED and bits == 4 and x2.dtype == torch.bfloat16 and x2.data_ptr() % 4 == 0
            and x2.stride(0) % 2 == 0)


def supports(bits: int, group_size: int, k: int) -> bool:
    """Whether this kernel takes a layer: 4/8-bit values, groups of a multiple of BLOCK_K
    columns or one group for all of K (group_size >= k), no per-column group index."""
    return bits in (4, 8) and group_size > 0 and (group_size % BLOCK_K == 0 or group_size >= k)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """See headrace.kernels.reference_quant.wna16_linear (groups contiguous, ``supports`` holds);
    ``tile``: one launch configuration instead of the pinned or fixed one."""
    n = qweight.shape[1]
    k = qweight.shape[0] * (32 // bits)
    if not supports(bits, group_size, k):
        raise ValueError(f"w4a16_linear takes 4/8-bit weights in groups of a multiple of {BLOCK_K} "
                         f"(or one group), not {bits}-bit groups of {group_size}")
    x2 = activations(x, k, perm)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        args = launch_args(x2, out)
        group = group_size if group_size < k else cdiv(k, BLOCK_K) * BLOCK_K
        args.update(X=x2, QW=qweight, S=scales, Z=zeros, B=qweight if bias is None else bias, K=k,
                    GROUP=group, BITS=bits, HAS_BIAS=bias is not None, ASM=UNPACK_ASM,
                    EVEN_K=k % BLOCK_K == 0, PACKED=_packed(x2, bits))
        TUNER(x2.shape[0], n, args, (args["M_BUCKET"], n, k, x.dtype, bits, bias is not None),
              tile, scheme=f"w{bits}a16")
    return out.reshape(*x.shape[:-1], n)
