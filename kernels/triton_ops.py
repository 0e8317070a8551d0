"""Triton versions of the data plane's row-wise kernels: write_kv, rms_norm, fused_add_rms_norm,
apply_rotary and silu_and_mul (paged attention lives in ``kernels.triton_attention``).

Each function has the signature and semantics of its twin in ``kernels.reference``, including
the points where the reference rounds to the activation dtype, so results agree to the last bit
or so. Inputs may be strided views (the q/k/v splits of ``qkv_proj``) as long as their last
dimension is contiguous; outputs are new contiguous tensors, except write_kv which writes the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    block = triton.next_power_of_2(n)
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
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
        x, out, x.stride(0), d, BLOCK=block, num_warps=_warps(block))
    return out


@triton.jit
def _rotary_kernel(X, POS, COS_SIN, OUT, stride_xt, stride_xh, stride_cs, H,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(POS + t)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = heads < H
    dtype = OUT.dtype.element_ty
    # As the reference: cos/sin are cast to x's dtype and every product and sum is rounded to it.
    cos = tl.load(COS_SIN + pos * stride_cs + d).to(dtype).to(tl.float32)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + d).to(dtype).to(tl.float32)
    x_ptr = X + t * stride_xt + heads * stride_xh + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out_ptr = OUT + (t * H + heads) * (2 * HALF) + d
    tl.store(out_ptr, o1.to(dtype), mask=mask)
    tl.store(out_ptr + HALF, o2.to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of x [tokens, heads, head_dim] (head_dim / 2 a power of two);
    cos_sin is [max_pos, head_dim] float32, cos first. Returns a new tensor."""
    x = _unit_last(x)
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        block_h = triton.next_power_of_2(heads)
        _rotary_kernel[(tokens,)](x, positions, cos_sin, out, x.stride(0), x.stride(1),
                                  cos_sin.stride(0), heads, HALF=head_dim // 2, BLOCK_H=block_h,
                                  num_warps=_warps(block_h * head_dim // 2))
    return out


@triton.jit
def _write_kv_kernel(KEY, VALUE, CACHE, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, block_size, H,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:  # padded token: nothing to write
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < H
    dst = CACHE + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot \
        + heads * stride_c_head + d
    dtype = CACHE.dtype.element_ty
    k = tl.load(KEY + t * stride_kt + heads * stride_kh + d, mask=mask)
    v = tl.load(VALUE + t * stride_vt + heads * stride_vh + d, mask=mask)
    tl.store(dst, k.to(dtype), mask=mask)
    tl.store(dst + stride_c_kv, v.to(dtype), mask=mask)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores key/value [tokens, kv_heads, head_dim] at their slots; slot -1 is skipped.
    kv_cache is [2, blocks, block_size, kv_heads, head_dim] with a contiguous last dimension."""
    key, value = _unit_last(key), _unit_last(value)
    tokens, heads, head_dim = key.shape
    if tokens == 0:
        return
    block_h = triton.next_power_of_2(heads)
    _write_kv_kernel[(tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), kv_cache.shape[2], heads, HEAD_DIM=head_dim, BLOCK_H=block_h,
        num_warps=_warps(block_h * head_dim))
