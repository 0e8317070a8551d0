"""Triton versions of the data plane's row-wise kernels: rms_norm, fused_add_rms_norm and
silu_and_mul (paged attention lives in ``headrace.kernels.triton_attention``; rotary and the KV
write run fused with the q/k norms in ``headrace.kernels.triton_prologue``), and the ``_fp8``
variants of the last two, which hand an FP8 layer its input quantised per token
(``headrace.kernels.reference_quant.Fp8Rows``) from the same pass: the rows are not written in bf16
and read back by a quantiser (in W3's FP8 decode steps that quantiser was a launch per GEMM, 4% of
the kernel time).

Each function has the signature and semantics of its twin in ``headrace.kernels.reference``,
including the points where the reference rounds to the activation dtype, so results agree to the
last bit or so. Inputs may be strided views (the q/k/v splits of ``qkv_proj``) as long as their last
dimension is contiguous; outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.reference_quant import FP8, FP8_MAX, FP8_MIN_SCALE, Fp8Rows
from headrace.kernels.triton_flash import INTERPRETED
from headrace.kernels.triton_e4m3 import to_e4m3
from headrace.kernels.triton_quant import per_token_fp8

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FMAX, _MIN_SCALE = tl.constexpr(FP8_MAX), tl.constexpr(FP8_MIN_SCALE)
SILU_FP8_MAX_COLS = 16384   # silu_and_mul_fp8 holds a row in one program; wider: two kernels


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous, else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [A, B, N] (a view where possible): rows are addressed by two strides, so the
    [tokens, heads, head_dim] views that q/k norms see need no copy."""
    n = x.shape[-1]
    return _unit_last(x.reshape(-1, x.shape[-2] if x.dim() >= 3 else 1, n))


def _warps(block: int) -> int:
    return min(8, max(1, block // 256))


@triton.jit
def _store_fp8_row(OUT_ROW, SCALE_ROW, cols, mask, y, ACT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Row y (float32) rounded to the activations' dtype ACT, as the unquantised kernel stores
    it, then per_token_fp8's scale (max|y| / 448, floored) and e4m3 values: the same bits."""
    y = y.to(ACT).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(y), axis=0) / _FMAX, _MIN_SCALE)
    tl.store(SCALE_ROW, s)
    q = to_e4m3(tl.clamp(y / s, -_FMAX, _FMAX), OUT_ROW.dtype.element_ty, ROUND_FIRST)
    tl.store(OUT_ROW + cols, q, mask=mask)


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, RES_OUT, SCALE, n_inner, stride_xa, stride_xb, stride_ra,
                     stride_rb, N, eps, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
                     ACT: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    a, b = row // n_inner, row % n_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual = x + residual, rounded to its dtype as torch does
        r = tl.load(R + a * stride_ra + b * stride_rb + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (h * rstd).to(x.dtype).to(tl.float32) * w
    if FP8_OUT:
        _store_fp8_row(OUT + row * N, SCALE + row, cols, mask, y, ACT, ROUND_FIRST)
    else:
        tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty), mask=mask)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              fp8: bool = False):
    """(rms_norm(x [+ residual]), x + residual or None); ``fp8``: the first as ``Fp8Rows``."""
    x3 = _as_rows(x)
    if residual is None:
        r3, res_out = x3, None
    else:
        r3 = _as_rows(residual)
        res_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                              device=x.device)
    normed_dtype = x.dtype if res_out is None else res_out.dtype
    out_dtype = torch.promote_types(weight.dtype, normed_dtype)
    out = torch.empty(x.shape, dtype=FP8 if fp8 else out_dtype, device=x.device)
    n = x.shape[-1]
    rows = x3.shape[0] * x3.shape[1]
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    block = next_pow2(n)
    _rms_norm_kernel[(rows,)](
        x3, r3, weight, out, out if res_out is None else res_out, scale, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), n, eps,
        HAS_RESIDUAL=res_out is not None, FP8_OUT=fp8, ACT=_TL_DTYPE[out_dtype],
        ROUND_FIRST=INTERPRETED, BLOCK=block, num_warps=_warps(block))
    if fp8:
        return Fp8Rows(out.view(rows, n), scale, out_dtype), res_out
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in float32; see headrace.kernels.reference.rms_norm."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one pass over the rows."""
    return _rms_norm(x, residual, weight, eps)


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """(rms_norm(x + residual) quantised per token, x + residual): see
    headrace.kernels.reference_quant.fused_add_rms_norm_fp8."""
    return _rms_norm(x, residual, weight, eps, fp8=True)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # torch rounds silu's output, then the product
    tl.store(OUT + row * D + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where gate_up is [..., 2 * d] with gate first."""
    d = gate_up.shape[-1] // 2
    x = _unit_last(gate_up.reshape(-1, 2 * d))
    out = torch.empty((*gate_up.shape[:-1], d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(d))
    _silu_and_mul_kernel[(x.shape[0], cdiv(d, block))](
        x, out, x.stride(0), d, BLOCK=block, num_warps=_warps(block))
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(X, OUT, SCALE, stride_x, D, ACT: tl.constexpr,
                             ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(ACT)   # rounded as silu_and_mul rounds it
    _store_fp8_row(OUT + row * D, SCALE + row, cols, mask, silu.to(tl.float32) * up, ACT,
                   ROUND_FIRST)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:
    """SiLU(gate) * up quantised per token (headrace.kernels.reference_quant.silu_and_mul_fp8): one
    program holds a row; rows wider than SILU_FP8_MAX_COLS take silu_and_mul, then the
    per-token quantiser."""
    d = gate_up.shape[-1] // 2
    x = _unit_last(gate_up.reshape(-1, 2 * d))
    if d > SILU_FP8_MAX_COLS:
        return Fp8Rows(*per_token_fp8(silu_and_mul(x)), gate_up.dtype)
    out = torch.empty((x.shape[0], d), dtype=FP8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    block = next_pow2(d)
    if x.shape[0]:
        _silu_and_mul_fp8_kernel[(x.shape[0],)](
            x, out, scale, x.stride(0), d, ACT=_TL_DTYPE[gate_up.dtype], ROUND_FIRST=INTERPRETED,
            BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return Fp8Rows(out, scale, gate_up.dtype)
