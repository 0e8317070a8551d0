"""Triton versions of the data plane's row-wise kernels: rms_norm, fused_add_rms_norm and
silu_and_mul (paged attention lives in ``kernels.triton_attention``; rotary and the KV write run
fused with the q/k norms in ``kernels.triton_prologue``).

Each function has the signature and semantics of its twin in ``kernels.reference``, including
the points where the reference rounds to the activation dtype, so results agree to the last bit
or so. Inputs may be strided views (the q/k/v splits of ``qkv_proj``) as long as their last
dimension is contiguous; outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host import cdiv, next_pow2


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
def _rms_norm_kernel(X, R, W, OUT, RES_OUT, n_inner, stride_xa, stride_xb, stride_ra, stride_rb,
                     N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty), mask=mask)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rms_norm(x [+ residual]), x + residual or None)."""
    x3 = _as_rows(x)
    if residual is None:
        r3, res_out = x3, None
    else:
        r3 = _as_rows(residual)
        res_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                              device=x.device)
    normed_dtype = x.dtype if res_out is None else res_out.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, normed_dtype),
                      device=x.device)
    n = x.shape[-1]
    block = next_pow2(n)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3, r3, weight, out, out if res_out is None else res_out, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), n, eps,
        HAS_RESIDUAL=res_out is not None, BLOCK=block, num_warps=_warps(block))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in float32; see kernels.reference.rms_norm."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one pass over the rows."""
    return _rms_norm(x, residual, weight, eps)


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
