"""Triton skinny W8A8 GEMM for FP8 layers at decode batch sizes (2..128 rows, and beyond in
tests): ``headrace.kernels.reference_quant.fp8_linear``'s semantics (e4m3 weight with per-row or one
scale, activations quantised per token to e4m3) on the FP8 tensor cores.

Why: the W8A16 skinny program (``headrace.kernels.triton_fp8_linear``) widens every weight value in
registers before its MMA: on SM90 the weight tile goes global -> shared (async copy) ->
registers -> converted -> the MMA, and at 16-64 rows it read its weight at 1.2-2.4 TB/s
(qkv / o / gate_up / down at M = 16: 0.85-0.97x of bf16 cuBLAS, H200, session 24), where a
decode GEMM's floor is the copy bandwidth (~4.3 TB/s). Here both operands stay e4m3: the
weight tile [BLOCK_N, BLOCK_K] is the MMA's wide operand straight from shared memory (Hopper's
wgmma at BLOCK_N >= 64) and the tokens' rows x^T [BLOCK_K, BLOCK_M] its narrow one (swapped
operands, as the W8A16 dot program), so a step issues no conversion at all. The rows come
quantised from the kernel that made them (``kernels.Fp8Rows``: the norm and SiLU kernels) or
from ``headrace.kernels.triton_quant.per_token_fp8``; their per-row scales multiply the float32 sums
before the per-column weight scale and the bias (``skinny_gemm.store_or_reduce``, which also
adds split-K partial sums in its self-cleaning workspace). The loops load without masks where
the shapes allow (``EVEN_K``, ``EVEN_N``; rows past M read the last row, never stored).

Launch tiles per row bucket and shape: pinned in kernels/quant_dispatch.json under the
``fp8_w8a8`` key by ``bench/quant_kernels.py``'s sweep, else the bucket's first with K split
by ``skinny_gemm.split_for``. Under the CPU interpreter the operands are widened to float32
(exact: a product of two e4m3 values fits float32's mantissa). No host synchronisation:
CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.skinny_gemm import (MAX_SPLIT, Tile, Tuner, launch_args, program_slice,
                                          store_or_reduce)
from headrace.kernels.reference_quant import FP8_MAX as _FP8_MAX, FP8_MIN_SCALE as _FP8_MIN_SCALE
from headrace.kernels.triton_e4m3 import to_e4m3
from headrace.kernels.triton_flash import INTERPRETED

ROUND_FIRST = tl.constexpr(INTERPRETED)   # triton_e4m3: the interpreter's cast needs it
GROUP = tl.constexpr(128)       # columns of x quantised together by the inline program
FP8_MAX = tl.constexpr(_FP8_MAX)
FP8_MIN_SCALE = tl.constexpr(_FP8_MIN_SCALE)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _w8a8_skinny_kernel(X, SX, W, S, B, OUT, WS, CNT, M, N, K, stride_xm, stride_wn, stride_s,
                        stride_om, M_BUCKET, SPLIT_K, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                        PIPE: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                        EVEN_N: tl.constexpr = False, QUANT_X: tl.constexpr = False):
    rows, cols, k_lo, k_hi = program_slice(K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    rows_in = tl.minimum(rows, M - 1)
    cols_in = cols if EVEN_N else tl.minimum(cols, N - 1)
    rk = tl.arange(0, BLOCK_K)
    w_at = W + cols_in[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]   # [BN, BK]
    x_at = X + rows_in[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None]   # [BK, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_at)
            xt = tl.load(x_at)
        else:
            k_ok = k0 + rk < k_hi
            w = tl.load(w_at, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_at, mask=k_ok[:, None], other=0.0)
        if QUANT_X:     # x's rows in their own dtype: quantised here, a scale per group
            tl.static_assert(BLOCK_K == GROUP)
            xt, sx = _quantise_group(xt)
            acc += _dot(w, xt, DOT_F32) * sx[None, :]
        else:
            acc = _dot(w, xt, DOT_F32, acc)
        w_at += BLOCK_K
        x_at += BLOCK_K
    if not QUANT_X:
        acc = acc * tl.load(SX + rows_in).to(tl.float32)[None, :]     # the rows' scales
    store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, stride_s, B,
                    HAS_BIAS, SPLIT_K, True)


@triton.jit
def _dot(w, xt, DOT_F32: tl.constexpr, acc=None):
    """w [BN, BK] @ xt [BK, BM] (+ acc) in float32, both e4m3 (widened under the interpreter)."""
    if DOT_F32:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _quantise_group(xt):
    """xt [GROUP, BM] (one group of K for each row) -> (e4m3 values, float32 scales [BM]):
    ``reference_quant.per_group_fp8``'s rounding (scale = max|x| / 448, at least its floor)."""
    xf = xt.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), axis=0) / FP8_MAX, FP8_MIN_SCALE)
    q = tl.clamp(xf / scale[None, :], -FP8_MAX, FP8_MAX)
    return to_e4m3(q, tl.float8e4nv, ROUND_FIRST), scale


def _tile(m: int, n: int, k: int = 128, warps: int = 4, stages: int = 4, split: int = 1) -> Tile:
    return Tile(m, n, k, warps, stages, split)


# Candidate tiles per row bucket: the first (unsplit) one is the fixed choice (K split by
# skinny_gemm.split_for) and the interpreter's; the rest are bench/quant_kernels.py's sweep.
# 64 weight rows a program at least (Hopper's wgmma takes its A operand 64 rows at a time;
# 16-32 columns a program, which need no split K at 16 rows but run as mma.sync on operands
# widened to float16, measured 13.6-15.4 us on qkv and o at 16 rows against 11.0-13.3 for the
# 64-column tiles, session 25); 128-256 bytes of each weight row a step, 3-5 stages in flight.
# The fixed tile splits K only below 2 programs an SM (``W8A8_PROGRAMS_PER_SM``; the other
# kernels' tiles take 4): on the H200 (session 24, M = 16, 16 x 64 x 128 tiles) gate_up's 448
# programs ran in 35.4 us unsplit and 42.9 split 2 ways, while qkv's 96, o's and down's 64
# were fastest split 4 ways.
_SMALL = [_tile(16, 64), _tile(16, 64, 128, 4, 4, 2), _tile(16, 64, 128, 4, 4, 4),
          _tile(16, 64, 256, 4, 3), _tile(16, 64, 256, 4, 3, 2), _tile(16, 64, 256, 4, 3, 4),
          _tile(16, 128, 128, 4, 4), _tile(16, 128, 128, 4, 4, 2), _tile(16, 128, 256, 8, 3),
          _tile(16, 64, 128, 4, 5, 2), _tile(16, 64, 128, 4, 5, 4), _tile(16, 64, 256, 4, 4, 2),
          _tile(16, 128, 128, 8, 4, 4), _tile(16, 64, 128, 4, 3, 8)]
TILES = {
    2: _SMALL, 4: _SMALL, 8: _SMALL, 16: _SMALL,
    32: [_tile(32, 64), _tile(32, 64, 128, 4, 4, 2), _tile(32, 64, 128, 4, 4, 4),
         _tile(32, 64, 256, 4, 3, 2), _tile(32, 128, 128, 4, 4), _tile(32, 128, 128, 4, 4, 2),
         _tile(32, 128, 256, 8, 3), _tile(32, 64, 256, 4, 3, 4)],
    64: [_tile(64, 64), _tile(64, 64, 128, 4, 4, 2), _tile(64, 64, 128, 4, 4, 4),
         _tile(64, 128, 128, 8, 4), _tile(64, 128, 128, 8, 4, 2), _tile(64, 64, 256, 4, 3, 2),
         _tile(64, 128, 128, 4, 3), _tile(64, 64, 256, 8, 3, 4), _tile(64, 128, 256, 8, 3, 2),
         _tile(64, 64, 128, 4, 5, 4)],
    128: [_tile(128, 128, 128, 8, 3), _tile(64, 128, 128, 8, 4), _tile(128, 64, 128, 4, 4),
          _tile(128, 128, 128, 8, 3, 2)],
}
TILES[1] = TILES[2]
TILES[256] = TILES[128]
if INTERPRETED:
    TILES = {b: ts[:1] for b, ts in TILES.items()}

W8A8_PROGRAMS_PER_SM = 2
TUNER = Tuner(triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
                                  "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(
    _w8a8_skinny_kernel), TILES, split_limits=lambda tile: (W8A8_PROGRAMS_PER_SM, MAX_SPLIT))


def w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, tile: Tile | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T + bias in ``out_dtype``: xq [M, K] e4m3 (rows
    contiguous), x_scale float32 [M] or [M, 1] (per token), weight [N, K] e4m3, weight_scale
    float32 [N] or one element, bias [N] or None. ``tile``: one launch configuration instead of
    the pinned or fixed one (tests, bench/quant_kernels.py's sweep)."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, the weight {weight.shape[1]}")
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    sx = x_scale.reshape(-1).float()
    scale = weight_scale.reshape(-1)
    if sx.numel() != m or scale.numel() not in (1, n):
        raise ValueError(f"scales: {sx.numel()} for {m} rows (want {m}), {scale.numel()} for "
                         f"{n} columns (want 1 or {n})")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m:
        args = launch_args(xq, out)
        args.update(X=xq, SX=sx, W=weight, S=scale, B=weight if bias is None else bias, K=k,
                    stride_wn=weight.stride(0),
                    stride_s=0 if scale.numel() == 1 else scale.stride(0),
                    HAS_BIAS=bias is not None, DOT_F32=INTERPRETED, PRECISION="ieee")
        key = (args["M_BUCKET"], n, k, out_dtype, bias is not None, scale.numel() == 1)
        TUNER(m, n, args, key, tile, scheme="fp8_w8a8")
    return out
