"""Triton skinny GEMM for FP8 weights at decode batch sizes: ``kernels.reference_quant.
fp8_weight_linear`` (W8A16 semantics: e4m3 weight, activations left in their own dtype).

Why: at decode (M = 1..~256 rows) a projection is bound by reading its weight, and FP8 halves
those bytes, but ``torch._scaled_mm`` (cuBLASLt, row-wise scales) was measured on the H200 to
read its weight at ~1.1 TB/s for M <= 256, a quarter of what the card copies (~4.3 TB/s): FP8
weights bought nothing on the qkv / o projections. This kernel is ``kernels.triton_linear``'s
design with a one-byte weight: each program owns BLOCK_N output columns for BLOCK_M rows,
streams its [BLOCK_N, K] slice of the weight once with wide loads along K (contiguous rows),
upcasts the e4m3 values to the activation dtype in registers (exact: e4m3's 3 mantissa bits
and range fit bfloat16, float16 and float32), accumulates x @ w^T in float32 and applies each
output column's float32 scale once, after the K loop, then adds the bias. Programs over the
row tiles of one column tile are launched next to each other (axis 0), so a weight tile read
from HBM serves them from L2. Where the output tiles are fewer than the SMs want (``_tiles``),
K is split into slices whose float32 partial sums are added atomically into a zeroed
workspace, as in ``kernels.triton_quant``'s W4A16 kernel. Fixed grid from static shapes, no
host synchronisation: CUDA-graph safe.

Why no activation quantisation here: in a memory-bound shape the arithmetic is not the
bottleneck, so running it on bf16 tensor cores instead of FP8 ones costs nothing while the
weight bytes (the cost) are the same FP8 bytes; W8A8's per-token quantiser would only add a
launch and a pass over x. Numerically this path is closer to the unquantised model than W8A8:
the only error is the weight's rounding to e4m3; the activations keep their bfloat16 (or
float16 / float32) values instead of being rounded to e4m3 (and, with a static input scale,
saturated at 448 * scale), so a layer's decode rows and its W8A8 prefill rows differ by that
activation rounding. A checkpoint's static ``input_scale`` is therefore not used here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there

MIN_PROGRAMS = 264          # as triton_quant's W4A16: 2 per SM of an H200 (132)
MIN_PROGRAMS_DECODE = 128   # narrow decode tiles: about one per SM
MAX_SPLIT = 4               # not yet swept for FP8 (bench/quant_kernels.py --sweep)


@triton.jit
def _fp8_skinny_kernel(X, W, S, B, OUT, M, N, K, K_PER, stride_xm, stride_wn, stride_s,
                       stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
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
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(dtype)                  # e4m3 -> x's dtype: exact
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    acc *= tl.load(S + cols * stride_s, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_at, acc.to(OUT.dtype.element_ty), mask=out_ok)
    else:                                # OUT is a zeroed float32 workspace the slices add into
        tl.atomic_add(out_at, acc, mask=out_ok, sem="relaxed")


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, split_k) for m rows of an [n, k] weight. One-byte
    weights: BLOCK_K 256 at decode is a 256-byte contiguous run per weight row (triton_linear's
    bf16 tiles read 512). Not yet tuned on the H200 (bench/quant_kernels.py --sweep)."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 32, 256, 4
    elif m <= 32:
        block_m, block_n, block_k, warps = 32, 64, 128, 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 64, 64, 128, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, 64, 8
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    least = MIN_PROGRAMS_DECODE if m <= 16 else MIN_PROGRAMS
    split = 1 if tiles >= least else min(MAX_SPLIT, triton.cdiv(least, tiles))
    return block_m, block_n, block_k, warps, max(1, min(split, k // (2 * block_k)))


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """See kernels.reference_quant.fp8_weight_linear. x [..., K] bfloat16 / float16 / float32,
    weight [N, K] e4m3 (rows contiguous), weight_scale float32 [N] (per channel) or one element
    (per tensor), bias [N] or None. ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, split_k)
    instead of ``_tiles``' choice (the sweep of bench/quant_kernels.py)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    scale = weight_scale.reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"weight_scale has {scale.numel()} elements for {n} rows (1 or {n})")
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, warps, split = config or _tiles(m, n, k)
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    dot_f32 = INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    acc = out if split == 1 else torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _fp8_skinny_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x2, weight, scale, weight if bias is None else bias, acc, m, n, k, k_per, x2.stride(0),
        weight.stride(0), 0 if scale.numel() == 1 else scale.stride(0), acc.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, PRECISION=precision, DOT_F32=dot_f32, num_warps=warps, num_stages=3)
    if split > 1:
        out.copy_(acc)
    return out.reshape(*x.shape[:-1], n)
