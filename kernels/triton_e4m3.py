"""Rounding float32 to e4m3 inside Triton kernels, the same on the GPU and under the CPU
interpreter: the activation quantisers (``headrace.kernels.triton_quant``, the norm and SiLU kernels
of ``headrace.kernels.triton_ops``, the W8A8 GEMM that quantises its own rows) and the FP8 KV
cache's stores (``headrace.kernels.triton_prologue``) share it.

Why a helper: on the GPU a float32 -> float8e4nv cast is one rounding to nearest even
(``cvt.rn.satfinite.e4m3x2.f32``), but the interpreter's cast loses the exponent's carry when
a value rounds up to the next power of two (31.5 -> 16 instead of 32), so kernels pass
``ROUND_FIRST`` there and the value is put on e4m3's grid in float32 first.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x, dtype, ROUND_FIRST: tl.constexpr):
    """float32 values in [-448, 448] -> e4m3 ``dtype``. ROUND_FIRST (the CPU interpreter, whose
    float8 cast loses the exponent carry when a value rounds up to a power of two) rounds to
    e4m3's grid in float32 first (3 mantissa bits, subnormal step 2^-9, ties to even through the
    1.5 * 2^23 trick) so the cast itself is exact."""
    if ROUND_FIRST:
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), -6.0)
        step = tl.exp2(e - 3.0)
        x = ((x / step + 12582912.0) - 12582912.0) * step
    return x.to(dtype)


@triton.jit
def scaled_e4m3(x, scale, dtype, ROUND_FIRST: tl.constexpr):
    """x / scale saturated to +-448, as e4m3 (an FP8 KV cache's store); NaN is stored as 0: an
    FP8 cache holds no NaN (``headrace.kernels.kv_layout``: attention reads slots past a context)."""
    y = x.to(tl.float32) / scale
    return to_e4m3(tl.clamp(tl.where(y == y, y, 0.0), -448.0, 448.0), dtype, ROUND_FIRST)
