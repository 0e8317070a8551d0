"""Plain-torch references of the quantized linear layers and of the quantisers they need.

These define the semantics the Triton twins (``headrace.kernels.triton_quant``) reproduce; the data
plane runs them on CPU and the tests compare against them.

* FP8 W8A8 (e4m3): weight ``[N, K]`` float8_e4m3fn with one float32 scale per output row
  (a per-tensor scale is that scale on every row); activations quantised per token (row) at run
  time (scale = max|x| / 448, at least 1 / (448 * 512), as vLLM) or with one static scale.
  ``y = (xq * sx) @ (wq * sw)^T``, computed in float32, returned in x's dtype.
  ``fp8_group_linear``: the same with one activation scale per token and 128 columns (the
  W8A8 kernel that quantises its own rows, ``headrace.kernels.triton_fp8_w8a8_inline``).
* FP8 weight only (W8A16, the GPU's decode path: ``headrace.kernels.triton_fp8_linear``): the same
  weight and scales, activations not quantised: ``y = x @ (wq * sw)^T`` in float32, returned in
  x's dtype (a static input scale does not apply).
* W4A16 / W8A16 (integer weights, activations unquantised): ``qweight`` ``[K / P, N]`` int32
  with P = 32 / bits values per word packed along K (value k sits at bits ``(k % P) * bits`` of
  word ``k // P``: GPTQ's layout), unsigned values ``q`` in ``[0, 2^bits)``; ``scales`` ``[G, N]``
  and ``zeros`` ``[G, N]`` (uint8) per group; input column k belongs to group ``g_idx[k]`` (or
  ``k // group_size``). ``w[n, k] = (q - zero) * scale`` rounded to x's dtype; ``perm`` (act
  order) reorders x's columns first: ``y = x[..., perm] @ w^T``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from headrace.kernels import reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Float values already divided by their scale -> e4m3 (saturating at +-448)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_token_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scale [M, 1] float32). Dynamic (a scale per row) unless a
    static ``input_scale`` (one float32 element) is given."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return to_fp8(xf / scale), scale


def per_group_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scale [M, ceil(K / group)] float32): a dynamic scale per
    row and ``group`` columns (the last group may be shorter), as ``per_token_fp8`` per row."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return to_fp8(xf / scale).view(m, -1)[:, :k], scale.view(m, groups)


class Fp8Rows(NamedTuple):
    """Activations quantised per token by the kernel that made them (``fused_add_rms_norm_fp8``,
    ``silu_and_mul_fp8``), for an FP8 layer's W8A8 GEMM: the same values ``per_token_fp8``
    gives for the activations that kernel would have written, with no pass over them between."""

    q: torch.Tensor        # [M, K] float8_e4m3fn
    scale: torch.Tensor    # [M, 1] float32: row m is q[m] * scale[m]
    dtype: torch.dtype     # the activations' dtype before quantisation (the GEMM's output's)


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """(rms_norm(x + residual) quantised per token, x + residual); x [M, K]."""
    h, residual = reference.fused_add_rms_norm(x, residual, weight, eps)
    return Fp8Rows(*per_token_fp8(h.reshape(-1, h.shape[-1])), h.dtype), residual


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:
    """SiLU(gate) * up quantised per token; gate_up [M, 2 * d]."""
    y = reference.silu_and_mul(gate_up)
    return Fp8Rows(*per_token_fp8(y.reshape(-1, y.shape[-1])), y.dtype)


def fp8_rows_linear(x: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear`` of activations already quantised: (q * scale) @ dequant(weight)^T."""
    w = dequantize_fp8(weight, weight_scale) if dense is None else dense
    y = (x.q.float() * x.scale) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], float32 per-row scales [N]): the on-the-fly FP8 path."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return to_fp8(w.float() / scale[:, None]), scale


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """weight [N, K] e4m3 with per-row [N] or per-tensor (one element) scales -> float32."""
    return weight.float() * weight_scale.float().reshape(-1, 1).expand(weight.shape[0], 1)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               dense: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T with x quantised per token (or statically);
    ``dense``: ``dequantize_fp8``'s result, when the caller keeps it."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    xq, sx = per_token_fp8(x2, input_scale)
    w = dequantize_fp8(weight, weight_scale) if dense is None else dense
    y = (xq.float() * sx) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_group_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                     group: int = 128) -> torch.Tensor:
    """``fp8_linear`` with x quantised per token and ``group`` columns (``per_group_fp8``):
    the semantics of the W8A8 kernel that quantises its own rows
    (``headrace.kernels.triton_fp8_w8a8_inline``)."""
    n, k = weight.shape
    xq, sx = per_group_fp8(x.reshape(-1, k), group)
    xd = xq.float() * sx.repeat_interleave(group, dim=1)[:, :k]
    w = dequantize_fp8(weight, weight_scale) if dense is None else dense
    y = xd @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T (+ bias), x unquantised; ``weight_scale`` [N] float32
    per output row, or one element for the whole tensor; ``dense`` as in ``fp8_linear``."""
    n, k = weight.shape
    w = dequantize_fp8(weight, weight_scale) if dense is None else dense
    y = x.reshape(-1, k).float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values q [N, K] (K a multiple of 32 / bits) -> qweight [K / P, N] int32."""
    per = 32 // bits
    n, k = q.shape
    if k % per:
        raise ValueError(f"input size {k} is not a multiple of {per} ({bits}-bit packing)")
    v = q.to(torch.int64).t().reshape(k // per, per, n)
    shifts = (torch.arange(per, dtype=torch.int64, device=q.device) * bits).view(1, per, 1)
    word = (v << shifts).sum(dim=1)                      # < 2^32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [K / P, N] int32 -> unsigned values [N, K] (uint8)."""
    per = 32 // bits
    shifts = (torch.arange(per, device=qweight.device, dtype=torch.int32) * bits).view(1, per, 1)
    v = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)   # [K / P, P, N]
    return v.reshape(-1, qweight.shape[1]).t().to(torch.uint8)


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [N, K] in ``dtype`` (g_idx [K]: the group of each packed column)."""
    q = unpack_along_k(qweight, bits).to(torch.float32)       # [N, K]
    g = g_idx.long()
    s = scales.float()[g].t()                                  # [N, K]
    z = zeros.float()[g].t()
    return ((q - z) * s).to(dtype)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, perm: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (columns reordered by ``perm`` when given) @ dequantised weight^T (+ bias).
    ``group_size`` > 0 promises ``g_idx == arange(K) // group_size`` (the kernels' fast path)."""
    if perm is not None:
        x = x.index_select(-1, perm)
    w = dequantize_wna16(qweight, scales, zeros, g_idx, bits, x.dtype)
    return torch.nn.functional.linear(x, w, bias)
