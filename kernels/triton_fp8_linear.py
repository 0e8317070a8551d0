"""Triton skinny GEMM for FP8 weights at decode batch sizes: ``headrace.kernels.reference_quant.
fp8_weight_linear`` (W8A16 semantics: e4m3 weight, activations left in their own dtype).

Why: at decode (M = 1..~128 rows) a projection is bound by reading its weight once, and FP8 halves
those bytes against bf16, but only if the kernel keeps the H200's memory busy: issue 32 measured the
first version of this kernel (fixed 16 x 32 x 256 tiles) and ``torch._scaled_mm`` (cuBLASLt
row-wise) reading FP8 weights at 0.2-1.1 TB/s where cuBLAS bf16 reads at 2-3.4 TB/s. So the launch
tile is chosen per row bucket and shape (``headrace.kernels.skinny_gemm.Tuner``: pinned by the
bench's measurements in kernels/quant_dispatch.json, else computed; autotuned over a compact list
per bucket only with HEADRACE_QUANT_AUTOTUNE=1) among two program shapes:

* FMA (M <= 4): each program owns BLOCK_N output columns for BLOCK_M rows and streams its
  [BLOCK_N, K] slice of the weight in [BLOCK_N, BLOCK_K] tiles of 256-1024 contiguous bytes
  per row (16-byte vector loads), upcasts e4m3 in registers (exact: e4m3's values all fit
  bfloat16, float16 and float32) and reduces w * x along K on the CUDA cores in float32.
  Tensor-core tiles would waste 15/16 of their rows on one token.
* tl.dot with swapped operands (M >= 2): acc^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @
  X^T, so the weight (upcast in registers, the MMA's A operand) fills the tensor core's
  64-row side and the few tokens its narrow side (16..128).

K is split over programs (float32 partial sums in the self-cleaning workspace) where output
tiles are few. Each output column's float32 scale (per channel, or one per tensor) is applied
once in the epilogue, then the bias. Fixed grid from static shapes, no host synchronisation:
CUDA-graph safe.

Why no activation quantisation here: in a memory-bound shape the arithmetic is not the
bottleneck, so running it on bf16 tensor cores or CUDA cores instead of FP8 ones costs nothing
while the weight bytes (the cost) are the same FP8 bytes; W8A8's per-token quantiser would only
add a launch and a pass over x. Numerically this path is closer to the unquantised model than
W8A8: the only error is the weight's rounding to e4m3 (a checkpoint's static ``input_scale`` is
therefore not used here), so a layer's decode rows and its W8A8 prefill rows differ by the
activations' e4m3 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.skinny_gemm import (MAX_SPLIT, PROGRAMS_PER_SM, Tile, Tuner, activations,
                                          launch_args, program_slice, store_or_reduce)
from headrace.kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there

CONVERT_ASM = tl.constexpr(not INTERPRETED)      # PTX conversions (the interpreter runs none)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _fp8_skinny_kernel(X, W, S, B, OUT, WS, CNT, M, N, K, stride_xm, stride_wn, stride_s,
                       stride_om, M_BUCKET, SPLIT_K, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                       PIPE: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                       EVEN_N: tl.constexpr = False):
    rows, cols, k_lo, k_hi = program_slice(K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    dtype = X.dtype.element_ty
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    x_rows = X + rows.to(tl.int64) * stride_xm
    if PIPE and not USE_DOT:      # one row a program
        tl.static_assert(BLOCK_M == 1)
        # columns past N read the last one (never stored): no masks in the loop
        cols_in = cols if EVEN_N else tl.minimum(cols, N - 1)
        acc = _fma_pipelined(X + tl.program_id(0).to(tl.int64) * stride_xm, W, stride_wn,
                             cols_in, K, k_lo, k_hi, BLOCK_N, BLOCK_K,
                             EVEN_K)   # grid: M programs, each row exists
        store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, stride_s,
                        B, HAS_BIAS, SPLIT_K, True)
        return
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            xt = tl.load(x_rows[None, :] + k[:, None], mask=k_ok[:, None] & row_ok[None, :],
                         other=0.0)
            w = w.to(dtype)                       # e4m3 -> x's dtype: exact
            if DOT_F32:
                w, xt = w.to(tl.float32), xt.to(tl.float32)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        else:
            x = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, stride_s, B,
                    HAS_BIAS, SPLIT_K, True)


@triton.jit
def _fma_pipelined(x_row, W, stride_wn, cols, K, k_lo, k_hi, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, 1] of the row at ``x_row`` over the K slice [k_lo, k_hi) on the CUDA cores
    (``cols`` inside N; K, the rows' strides and x's address multiples of 4 values): each step
    issues the next tile's loads before it multiplies the current one, and the products add up
    element-wise in registers, reduced across threads once.

    Machine code (Triton 3.6, SM90, ``python -m bench.gemm_sass``): a float8 tile's
    ``.to(float32)`` took its 16-byte loads apart byte by byte and put pairs together again
    for each e4m3x2 conversion (2.2 PRMT a value), and x, loaded broadcast over the tile's
    rows, was loaded and widened once per row a thread holds: 8 warp instructions a value.
    Here the weight is read as 32-bit words [BLOCK_N, BLOCK_K / 4], each converted whole
    (``_e4m3x4_to_f32``: value j of a word is its byte j), and x as 64-bit words of four
    16-bit values [BLOCK_K / 4], loaded once per word position a thread holds (a 1-D load
    expanded over the rows), value j widened by a shift or a mask. The next tile's start is
    clamped to the slice's last tile (loaded twice at the end) rather than masked, and with
    K in whole steps (EVEN_K) no load is masked."""
    KW: tl.constexpr = BLOCK_K // 4
    k_end = (K - 1) // BLOCK_K * BLOCK_K
    # the slice's first and last steps, both inside K (an empty slice past K loads the last
    # step and adds nothing)
    first = tl.minimum(k_lo, k_end) // 4
    last = tl.minimum(k_lo + tl.maximum(k_hi - k_lo - 1, 0) // BLOCK_K * BLOCK_K, k_end) // 4
    kw_hi = k_hi // 4
    rk = tl.arange(0, KW)
    w_at = W.to(tl.pointer_type(tl.int32), bitcast=True) \
        + cols[:, None].to(tl.int64) * (stride_wn // 4) + rk[None, :]
    if EVEN_K:
        w = tl.load(w_at + first)
    else:
        w = tl.load(w_at + first, mask=(first + rk < kw_hi)[None, :], other=0)
    x_at = x_row.to(tl.pointer_type(tl.int64), bitcast=True) + rk
    acc = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        nxt = tl.minimum(k0 // 4 + KW, last)
        if EVEN_K:
            w_next = tl.load(w_at + nxt)
            xw = tl.load(x_at + k0 // 4)
        else:
            w_next = tl.load(w_at + nxt, mask=(nxt + rk < kw_hi)[None, :], other=0)
            xw = tl.load(x_at + k0 // 4, mask=k0 // 4 + rk < kw_hi, other=0)
        w0, w1, w2, w3 = _e4m3x4_to_f32(w)
        x0, x1, x2, x3 = _x4_to_f32(xw.to(tl.uint64, bitcast=True), x_row.dtype.element_ty)
        acc += w0 * x0[None, :]
        acc += w1 * x1[None, :]
        acc += w2 * x2[None, :]
        acc += w3 * x3[None, :]
        w = w_next
    return tl.sum(acc, axis=1)[:, None]


@triton.jit
def _x4_to_f32(u, dtype: tl.constexpr):
    """The four 16-bit values (bfloat16 or float16) of 64-bit words as float32, value j in
    bits 16j..16j+15: a bfloat16 is float32's top half, so a shift or a mask widens it."""
    lo = u.to(tl.uint32)
    hi = (u >> 32).to(tl.uint32)
    if dtype == tl.bfloat16:
        return ((lo << 16).to(tl.float32, bitcast=True),
                (lo & 0xFFFF0000).to(tl.float32, bitcast=True),
                (hi << 16).to(tl.float32, bitcast=True),
                (hi & 0xFFFF0000).to(tl.float32, bitcast=True))
    else:
        return ((lo & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32),
                (lo >> 16).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32),
                (hi & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32),
                (hi >> 16).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32))


@triton.jit
def _e4m3x4_to_f32(words):
    """The four e4m3 values of int32 words as float32, exact, value j from byte j. On the GPU
    two e4m3x2 -> f16x2 conversions and four f16 -> f32 a word; the interpreter casts."""
    if CONVERT_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, h0, h1, h2, h3;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {h0, h1}, a;
            mov.b32 {h2, h3}, b;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        u = words.to(tl.uint32, bitcast=True)
        return ((u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
                ((u >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
                ((u >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
                (u >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32))


def _fma(m: int, n: int, k: int, warps: int = 4, split: int = 1) -> Tile:
    return Tile(m, n, k, warps, 3, split, dot=False)


def _pipe(m: int, n: int, k: int, warps: int = 4, split: int = 1, stages: int = 1) -> Tile:
    return Tile(m, n, k, warps, stages, split, dot=False, pipe=True)


# Candidate tiles per row bucket (bytes of one weight row per step = BLOCK_K). FMA tiles keep
# BLOCK_M * BLOCK_N * BLOCK_K / threads <= 64 values a thread; the first (unsplit) tile of a
# bucket is the fixed choice (K split by skinny_gemm.split_for) and the interpreter's; the rest
# are bench/quant_kernels.py's sweep and the autotuner's (HEADRACE_QUANT_AUTOTUNE=1). Pipelined
# FMA tiles (``_pipe``, one row a program) hold the next tile in registers, so they run without
# Triton's own pipelining (1 stage) unless listed otherwise. The fixed one-row tile, 8 rows of
# 1,024 bytes a step, split K only below PIPE_PROGRAMS_PER_SM programs an SM: on the H200
# (session 24, the word-wise program) it ran Llama-3.1-8B's qkv / o / gate_up / down in 10.6 /
# 7.1 / 34.3 / 17.7 us unsplit, within 12% of each shape's best tile, where 16 x 512 with K
# split for 4 programs an SM took 12.1 / 9.7 / 35.3 / 20.7.
PIPE_PROGRAMS_PER_SM = 2
TILES = {
    1: [_pipe(1, 8, 1024), _pipe(1, 16, 512), _pipe(1, 32, 256), _pipe(1, 32, 512, 8),
        _pipe(1, 16, 1024, 8), _pipe(1, 64, 256, 8), _pipe(1, 16, 256), _pipe(1, 16, 512, 4, 2),
        _pipe(1, 32, 256, 4, 2), _pipe(1, 16, 256, 4, 2), _pipe(1, 16, 512, 4, 4),
        _pipe(1, 16, 512, 4, 1, 3), _pipe(1, 16, 512, 8), _pipe(1, 8, 2048, 8),
        _pipe(1, 16, 1024, 8, 2), _fma(1, 16, 512)],
    2: [_fma(2, 16, 256), _fma(2, 32, 256, 8), _fma(2, 16, 512, 8), Tile(16, 64, 256),
        _fma(2, 16, 256, 4, 2), Tile(16, 64, 128, 4, 4, 4)],
    4: [Tile(16, 64, 256), _fma(4, 16, 256, 8), _fma(4, 16, 128), Tile(16, 32, 256, 4, 4),
        Tile(16, 64, 256, 4, 3, 2), Tile(16, 64, 128, 4, 4, 4)],
    8: [Tile(16, 64, 256), Tile(16, 32, 256, 4, 4), Tile(16, 128, 128), Tile(16, 64, 512, 8),
        Tile(16, 64, 256, 4, 3, 2), Tile(16, 128, 256, 8), Tile(16, 64, 256, 4, 4, 4),
        Tile(16, 64, 128, 4, 4, 4), Tile(16, 64, 256, 4, 3, 8), Tile(16, 128, 256, 8, 3, 4),
        Tile(16, 64, 256, 4, 3, 4)],
    32: [Tile(32, 64, 256), Tile(32, 128, 128), Tile(32, 64, 128, 4, 4), Tile(32, 128, 256, 8),
         Tile(32, 64, 256, 4, 3, 2), Tile(32, 64, 256, 4, 3, 4), Tile(32, 64, 128, 4, 4, 4)],
    64: [Tile(64, 64, 128), Tile(64, 128, 128, 8), Tile(64, 64, 256), Tile(64, 128, 128, 4, 4),
         Tile(64, 64, 128, 4, 3, 2), Tile(64, 64, 128, 4, 4, 4), Tile(64, 64, 256, 8, 3, 4),
         Tile(64, 128, 128, 8, 3, 4), Tile(64, 64, 128, 4, 3, 8), Tile(64, 64, 128, 4, 5, 4)],
    128: [Tile(128, 128, 64, 8), Tile(64, 128, 128, 8), Tile(128, 64, 128, 8),
          Tile(64, 64, 128, 4, 3, 2)],
}
TILES[16] = TILES[8]
TILES[256] = TILES[128]       # more rows than the skinny range (tests, the bench's M = 256)
if INTERPRETED:               # the CPU interpreter: one tile a bucket (no timing there), and
    # the first program that is not the one-row one (for what that one does not take)
    TILES = {b: list(dict.fromkeys(ts[:1] + [t for t in ts if not t.pipe][:1]))
             for b, ts in TILES.items()}


def _fits(tile: Tile, args: dict) -> bool:
    """The pipelined program reads the weight and x in words of four values: K and the
    weight's row stride a multiple of 4, the weight 4-byte aligned, x 16-bit (its rows 8-byte
    aligned: see ``fp8_weight_linear``)."""
    return not tile.pipe or (args["K"] % 4 == 0 and args["stride_wn"] % 4 == 0
                             and args["W"].data_ptr() % 4 == 0 and args["X"].element_size() == 2)


TUNER = Tuner(triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
                                  "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(
    _fp8_skinny_kernel), TILES, fits=_fits,
    split_limits=lambda tile: (PIPE_PROGRAMS_PER_SM if tile.pipe else PROGRAMS_PER_SM,
                               MAX_SPLIT))


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """See headrace.kernels.reference_quant.fp8_weight_linear. x [..., K] bfloat16 / float16 /
    float32, weight [N, K] e4m3 (rows contiguous), weight_scale float32 [N] (per channel) or one
    element (per tensor), bias [N] or None. ``tile``: one launch configuration instead of the pinned
    or fixed one (tests, bench/quant_kernels.py's sweep)."""
    n, k = weight.shape
    x2 = activations(x, k)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    scale = weight_scale.reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"weight_scale has {scale.numel()} elements for {n} rows (1 or {n})")
    if k % 4 == 0 and (x2.stride(0) % 4 or x2.data_ptr() % 8):
        x2 = x2.clone(memory_format=torch.contiguous_format)   # the one-row program's words
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        args = launch_args(x2, out)
        args.update(X=x2, W=weight, S=scale, B=weight if bias is None else bias, K=k,
                    stride_wn=weight.stride(0), stride_s=0 if scale.numel() == 1 else scale.stride(0),
                    HAS_BIAS=bias is not None)
        key = (args["M_BUCKET"], n, k, x.dtype, bias is not None, scale.numel() == 1,
               weight.stride(0), weight.data_ptr() % 4)
        if tile is not None and not _fits(tile, args):
            raise ValueError(f"{tile} takes 16-bit x, a 4-byte aligned weight and K, row stride "
                             f"multiples of 4")
        TUNER(x2.shape[0], n, args, key, tile, scheme="fp8")
    return out.reshape(*x.shape[:-1], n)
