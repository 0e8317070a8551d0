"""Quantized GEMMs of other libraries, behind one interface for ``headrace.kernels.quant_dispatch``:
whether a kernel can take a layer (``takes``), the one-time conversion of our canonical
tensors into its layout (``prepare_fp8`` / ``prepare_wna16``) and the call (``run``).

Canonical tensors (``headrace.dataplane.quantization.layers``): FP8 ``weight`` [N, K] e4m3 with
float32 ``weight_scale`` [N]; integer ``qweight`` [K / P, N] int32 (GPTQ packing, groups sorted),
``scales`` [G, N] float32, ``zeros`` [G, N] uint8, w = (q - z) * s.

* ``tinygemm`` (torch's own INT4 GEMM, ``aten._weight_int4pack_mm``; no package): 4-bit,
  groups of 32..256, bfloat16; w = (q - 8) * s + zero with a float zero ((8 - z) * s), scales
  and zeros in bfloat16 ([G, N, 2]), the weight in its tensor-core tiled int4 layout.
* ``gemlite`` (``pip install 'headrace[gemlite]'``; Triton kernels, pure Python): 4/8-bit
  W(q - z)s with [N, G] scales and zeros, and FP8 weight-only (``A16W8``), bfloat16/float16.
* ``fbgemm_rowwise`` / ``fbgemm_i4`` (``pip install 'headrace[fbgemm]'``: FBGEMM GenAI, CUTLASS;
  its wheel must match torch's minor version: 1.6.x for torch 2.11): row-wise W8A8 FP8
  (``quantize_fp8_per_row`` + ``f8f8bf16_rowwise``; ``run_fp8_rows`` takes rows the norm or
  SiLU kernel quantised, ``f8f8bf16_rowwise`` alone), and W4A16 with groups of 128
  (``preshuffle_i4`` + ``bf16i4bf16_shuffled``, w = q_signed * s + zero as tinygemm's).

The conversions are plain torch (tested on CPU against ``headrace.kernels.reference_quant``'s
dequantisation; tinygemm's also through torch's CPU twin of the op); the calls need a CUDA
device. A kernel's output is in x's dtype, the bias added after.
"""

from __future__ import annotations

import importlib
import pathlib

import torch

from headrace.kernels import quant_dispatch, reference_quant

PACKAGES = {"gemlite": ("gemlite", "gemlite", "pip install 'headrace[gemlite]'"),
            "fbgemm": ("fbgemm_gpu.experimental.gen_ai", "fbgemm-gpu-genai",
                       "pip install 'headrace[fbgemm]' (the wheel of torch's minor version)")}
KERNEL_LIBRARY = {"tinygemm": "torch", "gemlite": "gemlite", "gemlite_fp8": "gemlite",
                  "fbgemm_rowwise": "fbgemm", "fbgemm_i4": "fbgemm"}
TINYGEMM_INNER_K_TILES = 8
_missing: dict[str, str | None] = {}


def why_not(library: str) -> str | None:
    """Why ``library`` (torch, gemlite, fbgemm) cannot run here (None: it can); imported once."""
    if library not in _missing:
        _missing[library] = _check(library)
    return _missing[library]


def _check(library: str) -> str | None:
    if not torch.cuda.is_available():
        return f"{library}'s quantized GEMMs need a CUDA device"
    if library == "torch":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return f"torch {torch.__version__} has no aten._weight_int4pack_mm"
        return None
    module, package, hint = PACKAGES[library]
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:   # ImportError, or a wheel built for another torch failing to load
        return (f"the {package} package is not installed or does not import ({hint}): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if library == "gemlite":
        _gemlite_configs(loaded)
    return None


def _gemlite_configs(gemlite) -> None:
    """gemlite ships tuned launch configs per GPU and picks them by device name; an H200 (an
    H100's SM90 with more bandwidth) gets the H100's. A shape they do not hold would be
    autotuned at its first call ("fast": timing a dozen configs, each compiled for that N and
    K, seconds a shape and kernel): gemlite's single default config runs instead unless
    HEADRACE_QUANT_AUTOTUNE=1."""
    path = pathlib.Path(gemlite.__file__).parent / "configs" / "h100.json"
    if "H200" in torch.cuda.get_device_name() and path.exists():
        gemlite.load_config(str(path))
    if not quant_dispatch.AUTOTUNE:
        gemlite.set_autotune("default")


def takes(kernel: str, *, scheme: str, n: int, k: int, dtype: torch.dtype, bits: int = 8,
          group_size: int = 0, check_library: bool = True) -> bool:
    """Whether ``kernel`` can run a layer of ``scheme`` (fp8 / wna16) with an [n, k] weight,
    ``bits`` and contiguous groups of ``group_size`` (0: per-column group index), inputs in
    ``dtype``; with ``check_library`` its package must import."""
    library = KERNEL_LIBRARY.get(kernel)
    if library is None or check_library and why_not(library) is not None:
        return False
    half = dtype in (torch.bfloat16, torch.float16)
    if scheme == "fp8":
        if kernel == "gemlite_fp8":
            return half and n % 32 == 0 and k % 32 == 0
        if kernel == "fbgemm_rowwise":
            return dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
        return False
    if group_size <= 0:
        return False
    if kernel == "tinygemm":
        return (bits == 4 and dtype == torch.bfloat16 and group_size in (32, 64, 128, 256)
                and n % 8 == 0 and k % (TINYGEMM_INNER_K_TILES * 16) == 0)
    if kernel == "gemlite":
        return half and bits in (4, 8) and n % 32 == 0 and k % 32 == 0 and (
            group_size >= k or group_size in (32, 64, 128, 256, 512, 1024))
    if kernel == "fbgemm_i4":
        return bits == 4 and dtype == torch.bfloat16 and group_size == 128 and k % 128 == 0 \
            and n % 16 == 0
    return False


def float_zero_form(scales: torch.Tensor, zeros: torch.Tensor, bits: int):
    """(scale, zero) float32 [G, N] with w = (q - 2^(bits-1)) * scale + zero == (q - z) * s."""
    s = scales.float()
    return s, (float(1 << (bits - 1)) - zeros.float()) * s


def pack_nibbles(q: torch.Tensor, high_first: bool) -> torch.Tensor:
    """Unsigned 4-bit values [N, K] -> uint8 [N, K / 2]: column 2i and 2i + 1 in one byte,
    2i in the high nibble (tinygemm) or the low one (FBGEMM)."""
    even, odd = q[:, ::2].to(torch.uint8), q[:, 1::2].to(torch.uint8)
    return ((even << 4) | odd) if high_first else ((odd << 4) | (even & 0xF))


def signed_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values q (0..15) as the signed nibbles of q - 8 (two's complement, what
    FBGEMM's int4 kernels read: its weights are recentred, w = (q - 8) * scale + zero)."""
    return q.to(torch.uint8) ^ 8


def tinygemm_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[G, N, 2] bfloat16: (scale, float zero) per group and column."""
    s, z = float_zero_form(scales, zeros, 4)
    return torch.stack([s, z], dim=2).to(torch.bfloat16).contiguous()


def prepare_wna16(kernel: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bits: int, group_size: int, dtype: torch.dtype):
    """The library layout of an integer layer (on qweight's device)."""
    q = reference_quant.unpack_along_k(qweight, bits)                 # [N, K] uint8
    if kernel == "tinygemm":
        packed = pack_nibbles(q, high_first=True).contiguous()
        return (torch.ops.aten._convert_weight_to_int4pack(packed, TINYGEMM_INNER_K_TILES),
                tinygemm_scales_and_zeros(scales, zeros), group_size)
    if kernel == "gemlite":
        from gemlite.helper import A16Wn
        gs = group_size if group_size < q.shape[1] else q.shape[1]
        return A16Wn(device=q.device, dtype=dtype).from_weights(
            q.contiguous(), scales.t().contiguous().to(dtype), zeros.t().contiguous().to(dtype),
            W_nbits=bits, group_size=gs)
    if kernel == "fbgemm_i4":
        s, z = float_zero_form(scales, zeros, 4)
        packed = pack_nibbles(signed_nibbles(q), high_first=False).view(torch.int8).contiguous()
        wq, group_scale = torch.ops.fbgemm.preshuffle_i4(packed, s.to(torch.bfloat16).contiguous())
        return wq, group_scale, z.to(torch.bfloat16).contiguous()
    raise ValueError(f"{kernel} is not a library W4A16/W8A16 kernel")


def prepare_fp8(kernel: str, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype):
    """The library layout of an FP8 layer."""
    if kernel == "gemlite_fp8":
        from gemlite.helper import A16W8
        return A16W8(device=weight.device, dtype=dtype, fp8=torch.float8_e4m3fn).from_weights(
            weight, scales=weight_scale.reshape(-1, 1).to(dtype))
    if kernel == "fbgemm_rowwise":
        return weight.contiguous(), weight_scale.float().reshape(-1).contiguous()
    raise ValueError(f"{kernel} is not a library FP8 kernel")


# library W8A8 kernels that take activations already quantised per token (``Fp8Rows``, from the
# norm or SiLU kernel before the layer) instead of quantising them themselves
TAKES_FP8_ROWS = ("fbgemm_rowwise",)


def run_fp8_rows(kernel: str, state, rows: reference_quant.Fp8Rows,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = rows (e4m3 [M, K] and their per-token scales) through ``kernel``, one of
    ``TAKES_FP8_ROWS``: the GEMM alone, no quantiser launch before it."""
    if kernel != "fbgemm_rowwise":
        raise ValueError(f"{kernel!r} does not take quantised rows")
    w, ws = state
    y = torch.ops.fbgemm.f8f8bf16_rowwise(rows.q, w, rows.scale.reshape(-1), ws, use_fast_accum=True)
    y = y.to(rows.dtype)
    return y if bias is None else y + bias


def run(kernel: str, state, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] (contiguous rows, act-order already applied) through ``kernel``."""
    if kernel == "tinygemm":
        w, sz, group = state
        y = torch.ops.aten._weight_int4pack_mm(x2, w, group, sz)
    elif kernel in ("gemlite", "gemlite_fp8"):
        y = state(x2)
    elif kernel == "fbgemm_i4":
        y = torch.ops.fbgemm.bf16i4bf16_shuffled(x2, *state)
    elif kernel == "fbgemm_rowwise":
        w, ws = state
        xq, xs = torch.ops.fbgemm.quantize_fp8_per_row(x2)
        y = torch.ops.fbgemm.f8f8bf16_rowwise(xq, w, xs, ws, use_fast_accum=True)
    else:
        raise ValueError(f"unknown library kernel {kernel!r}")
    y = y.to(x2.dtype)
    return y if bias is None else y + bias
