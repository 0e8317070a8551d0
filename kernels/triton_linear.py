"""Triton twin of ``headrace.kernels.reference.linear`` for skinny inputs (a decode of a few
sequences).

At batch 1-16 a projection is a matrix-vector product: the time is reading the weight, yet the
library GEMMs picked for M <= 16 reach about a third of the bandwidth on Qwen3-0.6B's small
matrices and some add a split-K reduction kernel. Here each program owns BLOCK_N output
columns for every row, streams its [BLOCK_N, K] slice of the weight once (float32 accumulate)
and writes the result: one launch, the weight read once, no reduction pass. Larger batches
keep torch's GEMM (``kernels.linear`` dispatches on the row count), and so do weights whose
rows are long (``_tiles``: the sweep in bench/linear_tune.py found torch faster there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv
from headrace.kernels.triton_flash import INTERPRETED   # bfloat16 tl.dot operands widened there

MAX_ROWS = 16


@triton.jit
def _skinny_kernel(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_ok, col_ok = rows[:, None] < M, cols[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + k, mask=row_ok & (k < K), other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k, mask=col_ok & (k < K), other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok & (cols[None, :] < N))


def _tiles(n: int, k: int) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, stages) for an [n, k] weight, or None where torch's GEMM is faster.
    From bench/linear_tune.py on the H200 (bf16, Qwen3-0.6B's projections at batch 1-16):
    long reductions (k > 2048) leave too few programs to stream the weight fast."""
    if k > 2048:
        return None
    if n >= 6144:
        return 64, 256, 3
    if n >= 4096:
        return 32, 128, 5
    return 16, 256, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., K] with at most MAX_ROWS rows where the kernel beats
    torch's GEMM; torch's GEMM otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    tiles = _tiles(n, k)
    if rows == 0 or rows > MAX_ROWS or x.dtype != weight.dtype or tiles is None:
        return torch.nn.functional.linear(x, weight, bias)
    block_n, block_k, stages = tiles
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    dot_f32 = INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    _skinny_kernel[(cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k, x2.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k if x.element_size() <= 2 else 128, PRECISION=precision, DOT_F32=dot_f32,
        num_warps=4, num_stages=stages)
    return out.view(*x.shape[:-1], n)
