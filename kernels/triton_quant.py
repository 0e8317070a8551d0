"""Triton twins of ``headrace.kernels.reference_quant``: the quantized linear layers on the GPU.

* ``fp8_linear``: FP8 weights. Up to ``FP8_SKINNY_MAX_ROWS`` rows (decode) by default the
  FP8-weight skinny GEMM of ``headrace.kernels.triton_fp8_linear`` (W8A16: x not quantised). Above it
  (or with ``kernel="scaled_mm"``) a Triton kernel quantises the activations to e4m3 (one
  program per row: max|x| -> scale, then x / scale; or one static scale), then
  ``torch._scaled_mm`` runs the GEMM on the FP8 tensor cores with row-wise scales (scale_a
  [M, 1], scale_b [1, N], float32) and a bfloat16 output (cast to x's dtype when that differs).
  ``fp8_kernel(m)`` names the default for m rows; ``headrace.kernels.quant_dispatch`` chooses per layer,
  also among the W8A8 skinny GEMMs (``kernel="fp8_w8a8"``: ``headrace.kernels.triton_fp8_w8a8`` after
  the quantiser or on ``Fp8Rows``; ``"fp8_w8a8_inline"``: ``headrace.kernels.triton_fp8_w8a8_inline``,
  x quantised per token and 128 columns in the GEMM).
* ``wna16_linear``: W4A16 and W8A16. Up to ``skinny_gemm.MAX_ROWS`` rows, for groups of a
  multiple of 128 columns (or one group), the decode kernel of ``headrace.kernels.triton_w4a16``
  (``kernel="triton_skinny"``; ``"triton_tiled"``: ``headrace.kernels.triton_w4a16_tiled`` on the
  weight's tiled copy, which the caller passes); otherwise (``kernel="triton"``) the general kernel here: each
  program owns a BLOCK_M x BLOCK_N tile of the output and walks K: it loads the packed int32
  words of a [BLOCK_K, BLOCK_N] weight tile (GPTQ layout, 32 / BITS values per word along K),
  shifts the values out, dequantises them with their group's scale and zero ((q - z) * s,
  rounded to x's dtype) in registers and accumulates x @ w in float32. Groups are contiguous
  in K (act-order checkpoints are permuted at load, and x's columns with them); when a group
  spans whole K tiles one scale row is loaded per tile, otherwise (or with a per-column group
  index) the scales are gathered per column. Where output tiles are few, K is split over
  programs (``_tiles``) whose float32 partial sums are added atomically into a zeroed
  workspace, then cast.

All launch fixed grids from static shapes, with no host synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels import (skinny_gemm, triton_fp8_linear, triton_fp8_w8a8,
                              triton_fp8_w8a8_inline, triton_w4a16, triton_w4a16_tiled)
from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.triton_e4m3 import to_e4m3
from headrace.kernels.reference_quant import FP8, FP8_MAX, FP8_MIN_SCALE, Fp8Rows
from headrace.kernels.triton_flash import INTERPRETED as _INTERPRETED   # bfloat16 tl.dot operands widened there


@triton.jit
def _per_token_fp8_kernel(X, XQ, SCALE, S_IN, K, stride_xm, stride_qm, STATIC: tl.constexpr,
                          FMAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
                          ROUND_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if STATIC:
        s = tl.load(S_IN).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(X + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        s = tl.maximum(tl.max(amax, axis=0) / FMAX, MIN_SCALE)
    tl.store(SCALE + row, s)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0)
        xq = tl.clamp(x.to(tl.float32) / s, -FMAX, FMAX)
        tl.store(XQ + row * stride_qm + k0 + cols, to_e4m3(xq, XQ.dtype.element_ty, ROUND_FIRST),
                 mask=k0 + cols < K)


def per_token_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """See headrace.kernels.reference_quant.per_token_fp8 (x [M, K], last dim contiguous)."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _per_token_fp8_kernel[(m,)](
            x, xq, scale, scale if input_scale is None else input_scale, k, x.stride(0),
            xq.stride(0), STATIC=input_scale is not None, FMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
            BLOCK_K=min(1024, next_pow2(k)), ROUND_FIRST=_INTERPRETED, num_warps=4)
    return xq, scale


# Rows up to which fp8_linear takes the skinny FP8-weight kernel (W8A16) by default instead of
# activation quantisation + _scaled_mm (W8A8): the skinny kernels' tuned range. Per layer and
# row bucket headrace.kernels.quant_dispatch chooses from the H200's measurements (bench/quant_kernels.py).
FP8_SKINNY_MAX_ROWS = skinny_gemm.MAX_ROWS
FP8_KERNELS = ("fp8_skinny", "fp8_w8a8", "fp8_w8a8_inline", "scaled_mm")
WNA16_KERNELS = ("triton_skinny", "triton_tiled", "triton")


def fp8_kernel(m: int) -> str:
    """The kernel fp8_linear runs by default for m rows: 'fp8_skinny' or 'scaled_mm'."""
    return "fp8_skinny" if m <= FP8_SKINNY_MAX_ROWS else "scaled_mm"


def wna16_kernel(m: int, bits: int, group_size: int, k: int) -> str:
    """The kernel wna16_linear runs by default: 'triton_skinny' or 'triton'."""
    skinny = m <= skinny_gemm.MAX_ROWS and triton_w4a16.supports(bits, group_size, k)
    return "triton_skinny" if skinny else "triton"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               kernel: str | None = None) -> torch.Tensor:
    """See headrace.kernels.reference_quant.fp8_linear (W8A8; the skinny kernel's rows:
    fp8_weight_linear, W8A16). weight [N, K] e4m3 (row-major, so weight.t() is the column-major
    operand _scaled_mm wants), weight_scale [N] float32. ``kernel``: one of FP8_KERNELS
    instead of ``fp8_kernel``'s choice (the layer's dispatch, the benchmark, the tests).
    x may be ``Fp8Rows`` (quantised by the kernel that made them): a W8A8 kernel runs
    (``fp8_w8a8`` when asked for, or ``fp8_w8a8_inline``, else _scaled_mm).
    ``fp8_w8a8_inline`` quantises float rows per token and 128 columns itself
    (``reference_quant.fp8_group_linear``), unless a static ``input_scale`` is given: then the
    rows are quantised with it first and ``fp8_w8a8`` runs, as the other W8A8 kernels do."""
    n, k = weight.shape
    if kernel is not None and kernel not in FP8_KERNELS:
        raise ValueError(f"kernel must be one of {FP8_KERNELS}, not {kernel!r}")
    if isinstance(x, Fp8Rows):
        if kernel in ("fp8_w8a8", "fp8_w8a8_inline"):
            return triton_fp8_w8a8.w8a8_linear(x.q, x.scale, weight, weight_scale, bias, x.dtype)
        return _scaled_mm(x.q, x.scale, weight, weight_scale, bias).to(x.dtype)
    x2 = x.reshape(-1, k)
    kernel = kernel or fp8_kernel(x2.shape[0])
    if kernel == "fp8_skinny":
        return triton_fp8_linear.fp8_weight_linear(x, weight, weight_scale, bias)
    if kernel == "fp8_w8a8_inline" and input_scale is None:
        return triton_fp8_w8a8_inline.w8a8_inline_linear(x, weight, weight_scale, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = per_token_fp8(x2, input_scale)
    if kernel in ("fp8_w8a8", "fp8_w8a8_inline"):
        out = triton_fp8_w8a8.w8a8_linear(*rows, weight, weight_scale, bias, x.dtype)
    else:
        out = _scaled_mm(*rows, weight, weight_scale, bias).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def _scaled_mm(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(xq * sx) @ (weight * weight_scale)^T on the FP8 tensor cores, in bfloat16."""
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight_scale.view(1, -1),
                            bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16)


@triton.jit
def _wna16_kernel(X, QW, S, Z, GIDX, B, OUT, M, N, K, K_PER, stride_xm, stride_om,
                  BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
                  DOT_F32: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    k_lo = pid_k * K_PER                 # K_PER is a multiple of BLOCK_K: tiles stay in one slice
    k_hi = tl.minimum(K, k_lo + K_PER)
    row_ok, col_ok = rows < M, cols < N
    dtype = X.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # each packed word loaded once, its PER values shifted out into PER rows of the tile
        kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
        word = tl.load(QW + kw[:, None].to(tl.int64) * N + cols[None, :],
                       mask=(kw[:, None] < K // PER) & col_ok[None, :], other=0)
        shifts = tl.arange(0, PER) * BITS
        q = (word[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))   # row i * PER + j: value j of word row i
        if HAS_GIDX or GROUP_SIZE % BLOCK_K != 0:   # a scale row per column of the tile
            if HAS_GIDX:
                g = tl.load(GIDX + k, mask=k_ok, other=0)
            else:
                g = k // GROUP_SIZE
            sz = g[:, None].to(tl.int64) * N + cols[None, :]
            sz_ok = k_ok[:, None] & col_ok[None, :]
        else:                                       # the whole tile is in one group
            sz = (k0 // GROUP_SIZE) * N + cols[None, :]
            sz_ok = col_ok[None, :]
        s = tl.load(S + sz, mask=sz_ok, other=0.0).to(tl.float32)
        z = tl.load(Z + sz, mask=sz_ok, other=0).to(tl.int32)
        w = ((q - z).to(tl.float32) * s).to(dtype)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_at, acc.to(OUT.dtype.element_ty), mask=out_ok)
    else:                                # OUT is a zeroed float32 workspace the slices add into
        tl.atomic_add(out_at, acc, mask=out_ok, sem="relaxed")


MIN_PROGRAMS = 264          # 2 per SM of an H200 (132): fewer output tiles than this split K
MIN_PROGRAMS_DECODE = 128   # narrow decode tiles: about one per SM is enough (the sweep)
MAX_SPLIT = 4        # the H200 sweep (bench/quant_kernels.py --sweep): more splits lose to the
                     # zeroing, the atomics and the cast


def _tiles(m: int, n: int, k: int, bits: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, split_k). Decode-sized inputs get narrow column tiles
    (many programs, the weight streamed once); where the output tiles are still fewer than
    MIN_PROGRAMS, K is split into slices whose partial sums are added atomically (float32),
    each slice at least two K tiles long."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 32, 128, 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 64, 64, 64, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, 32, 8
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    least = MIN_PROGRAMS_DECODE if m <= 16 else MIN_PROGRAMS
    split = 1 if tiles >= least else min(MAX_SPLIT, cdiv(least, tiles))
    return block_m, block_n, block_k, warps, max(1, min(split, k // (2 * block_k)))


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, perm: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None = None,
                 config: tuple[int, int, int, int, int] | None = None,
                 kernel: str | None = None, tiled: torch.Tensor | None = None) -> torch.Tensor:
    """See headrace.kernels.reference_quant.wna16_linear. ``group_size`` > 0 (groups contiguous and
    equal) lets the kernels index scales by k // group_size; 0 makes the general kernel read
    ``g_idx``. ``kernel``: one of WNA16_KERNELS instead of ``wna16_kernel``'s choice
    (``triton_tiled`` runs on ``tiled``, ``triton_w4a16_tiled.pack_tiled(qweight)``, which the
    caller keeps); ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, split_k) of the general
    kernel instead of ``_tiles``' choice (bench/quant_kernels.py's sweep)."""
    n = qweight.shape[1]
    k = qweight.shape[0] * (32 // bits)
    x2 = x.reshape(-1, k)
    kernel = kernel or ("triton" if config else wna16_kernel(x2.shape[0], bits, group_size, k))
    if kernel == "triton_skinny":
        return triton_w4a16.w4a16_linear(x, qweight, scales, zeros, perm, bits, group_size, bias)
    if kernel == "triton_tiled":
        if tiled is None:
            raise ValueError("kernel 'triton_tiled' runs on the weight's tiled layout: pass "
                             "tiled=triton_w4a16_tiled.pack_tiled(qweight)")
        return triton_w4a16_tiled.w4a16_tiled_linear(x, tiled, scales, zeros, group_size, perm,
                                                     bias)
    if kernel != "triton":
        raise ValueError(f"kernel must be one of {WNA16_KERNELS}, not {kernel!r}")
    x2 = skinny_gemm.activations(x, k, perm)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, warps, split = config or _tiles(m, n, k, bits)
    if 16 <= group_size < block_k and group_size & (group_size - 1) == 0:   # one scale row a tile
        block_k = group_size
    k_per = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per)
    dot_f32 = _INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    acc = out if split == 1 else torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _wna16_kernel[(cdiv(m, block_m), cdiv(n, block_n), split)](
        x2, qweight, scales, zeros, g_idx, qweight if bias is None else bias, acc, m, n, k, k_per,
        x2.stride(0), acc.stride(0), BITS=bits, GROUP_SIZE=max(group_size, 1),
        HAS_GIDX=group_size <= 0, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split, PRECISION=precision, DOT_F32=dot_f32, num_warps=warps,
        num_stages=3)
    if split > 1:
        out.copy_(acc)
    return out.reshape(*x.shape[:-1], n)
