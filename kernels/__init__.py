"""Hot kernels of the data plane: the functions exported here are what the model calls.

Each op has a plain-torch reference in ``headrace.kernels.reference`` and a Triton version (in
``headrace.kernels.triton_ops``, ``headrace.kernels.triton_attention`` (with ``headrace.kernels.triton_decode`` and
``headrace.kernels.triton_flash``; ``unified_attention``: ``headrace.kernels.triton_unified``), ``headrace.kernels.triton_prologue``, ``headrace.kernels.triton_linear``,
``headrace.kernels.triton_sampling`` or ``headrace.kernels.triton_bitmask`` (structured outputs' token mask); the batched LoRA update
``lora_shrink`` / ``lora_expand`` / ``lora_add``: ``headrace.kernels.reference_lora`` and ``headrace.kernels.triton_lora``
(``lora_linear`` / ``lora_update``, a decode's projection with its update, or the update alone, in one
launch: ``headrace.kernels.triton_lora_linear``); the quantized linears ``fp8_linear`` and ``wna16_linear``:
``headrace.kernels.reference_quant`` and ``headrace.kernels.triton_quant``) that must match it. The choice is resolved once, at import, from
the environment variable ``HEADRACE_KERNELS``:

* ``auto`` (default): Triton for CUDA tensors when CUDA is available and triton imports, the
  reference otherwise (a per-call ``is_cuda`` check on the first argument; CPU-only hosts never
  import triton);
* ``triton``: Triton for every tensor (with ``TRITON_INTERPRET=1`` this runs on CPU: tests);
* ``reference``: the reference everywhere.

``paged_attention`` always accepts the Triton version's optional host-side hints (``max_query_len``,
``decode_only``, ``num_decodes``, ``decode_order``); the reference ignores them. Its ``flash``
argument (a ``headrace.kernels.flash_attn4.Plan``, made once per step when the step's
``headrace.kernels.attention_policy`` choice is flash-attn-4) sends a CUDA step's prefill part to
flash-attn-4 instead (``--attention-backend``); CPU tensors and ``reference`` ignore it.
``copy_blocks`` (copy on write, rare) is plain torch indexing on every device.
``batch_invariant.enable()`` (``--deterministic``) rebinds ``linear``, ``paged_attention`` and
``unified_attention`` to batch-invariant twins (``headrace.kernels.batch_invariant``).
``fused_add_rms_norm_fp8`` and ``silu_and_mul_fp8`` return their rows quantised per token
(``Fp8Rows``), for an FP8 layer that would quantise them itself (``fp8_linear`` takes them).
``fp8_linear`` and ``wna16_linear`` take a ``kernel`` name where Triton runs (the quantized layers
pass ``headrace.kernels.quant_dispatch``'s choice; the reference ignores it): ``fp8_linear_kernel``
/ ``wna16_linear_kernel`` say which kernel an input of a layer would take (``reference`` where the
reference runs), for benchmarks and logs; ``on_triton(x)`` whether the Triton twins run for ``x``.
"""

from __future__ import annotations

import os

import torch

from headrace.kernels import batch_invariant, flash_attn4, reference, reference_lora, reference_quant

MODE = os.environ.get("HEADRACE_KERNELS", "auto")
if MODE not in ("auto", "triton", "reference"):
    raise ValueError(f"HEADRACE_KERNELS must be auto, triton or reference, not {MODE!r}")


def _load_triton():
    if MODE == "reference" or (MODE == "auto" and not torch.cuda.is_available()):
        return None
    try:
        from headrace.kernels import (triton_attention, triton_bitmask, triton_linear, triton_lora,
                                      triton_lora_linear, triton_ops, triton_prologue, triton_quant,
                                      triton_sampling, triton_unified)
    except ImportError:
        if MODE == "triton":
            raise
        return None
    return {"paged_attention": triton_attention, "sample_race": triton_sampling,
            "qk_norm_rope_write_kv": triton_prologue, "linear": triton_linear,
            "fp8_linear": triton_quant, "wna16_linear": triton_quant,
            "apply_token_bitmask": triton_bitmask, "unified_attention": triton_unified,
            "lora_shrink": triton_lora, "lora_expand": triton_lora, "lora_add": triton_lora,
            "lora_linear": triton_lora_linear, "lora_update": triton_lora_linear}, triton_ops


def _reference_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                         max_query_len=None, decode_only=None, num_decodes=0, decode_order=None,
                         k_scale=1.0, v_scale=1.0, out=None):
    """headrace.kernels.reference.paged_attention, taking (and ignoring) the Triton version's hints."""
    result = reference.paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables,
                                       scale, k_scale, v_scale)
    return result if out is None else out.copy_(result)


def _reference_unified(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                       k_scale=1.0, v_scale=1.0, out=None):
    """headrace.kernels.reference.paged_attention with triton_unified's padding: query rows past
    ``query_start_loc[-1]`` keep their value in ``out``."""
    result = reference.paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables,
                                       scale, k_scale, v_scale)
    if out is None:
        return result
    real = torch.arange(query.shape[0], device=query.device) < query_start_loc[-1]   # no sync
    return out.copy_(torch.where(real[:, None, None], result, out))


def _on_cuda(fast, slow):
    """fast for CUDA tensors (judged by the first argument), slow otherwise."""
    def op(x, *args, **kwargs):
        return (fast if x.is_cuda else slow)(x, *args, **kwargs)
    op.__name__, op.__doc__ = slow.__name__, slow.__doc__
    return op


def _select(slow, name: str):
    """The function the model calls for op ``name``: its reference ``slow`` or a Triton twin."""
    if _triton is None:
        return slow
    own_module, ops = _triton
    fast = getattr(own_module.get(name, ops), name)
    return fast if MODE == "triton" else _on_cuda(fast, slow)


_triton = _load_triton()
rms_norm = _select(reference.rms_norm, "rms_norm")
fused_add_rms_norm = _select(reference.fused_add_rms_norm, "fused_add_rms_norm")
silu_and_mul = _select(reference.silu_and_mul, "silu_and_mul")
# their outputs quantised per token in the same pass, for an FP8 layer's W8A8 GEMM
Fp8Rows = reference_quant.Fp8Rows
fused_add_rms_norm_fp8 = _select(reference_quant.fused_add_rms_norm_fp8, "fused_add_rms_norm_fp8")
silu_and_mul_fp8 = _select(reference_quant.silu_and_mul_fp8, "silu_and_mul_fp8")
_paged_attention = _select(_reference_attention, "paged_attention")


def paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                    flash=None, out=None, **hints):
    """Causal attention of variable-length queries over paged KV (headrace.kernels.reference's
    semantics); ``flash``: the step's flash-attn-4 plan, or None; ``out``: where the result
    goes (a tensor of the query's shape; the Triton kernels write it directly)."""
    if flash is None or not query.is_cuda or MODE == "reference":
        return _paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                out=out, **hints)
    result = flash_attn4.paged_attention(query, kv_cache, flash, scale, _paged_attention,
                                         hints.get("decode_order"))
    return result if out is None else out.copy_(result)


# One launch for a whole mixed batch, its grid by token count (full CUDA graphs of mixed steps)
unified_attention = _select(_reference_unified, "unified_attention")
sample_race = _select(reference.sample_race, "sample_race")
apply_token_bitmask = _select(reference.apply_token_bitmask, "apply_token_bitmask")
qk_norm_rope_write_kv = _select(reference.qk_norm_rope_write_kv, "qk_norm_rope_write_kv")
linear = _select(reference.linear, "linear")
copy_blocks = reference.copy_blocks   # one indexed copy per layer: torch is the kernel
# multi-LoRA serving: the batched low-rank update of the tokens of each adapter slot
LoraMeta = reference_lora.LoraMeta
lora_shrink = _select(reference_lora.lora_shrink, "lora_shrink")
lora_expand = _select(reference_lora.lora_expand, "lora_expand")
lora_add = _select(reference_lora.lora_add, "lora_add")
lora_linear = _select(reference_lora.lora_linear, "lora_linear")   # a decode's projection + update
lora_update = _select(reference_lora.lora_update, "lora_update")   # lora_add, a decode's in one launch


def on_triton(x: torch.Tensor | str | torch.device) -> bool:
    """Whether the Triton twins run for a tensor (or device): HEADRACE_KERNELS and the device."""
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    return _triton is not None and (MODE == "triton" or device.type == "cuda")


def fp8_linear(x, weight, weight_scale, input_scale=None, bias=None, kernel=None, dense=None):
    """headrace.kernels.reference_quant.fp8_linear's semantics; ``kernel`` (fp8_skinny / fp8_w8a8 /
    fp8_w8a8_inline (per 128 columns: ``fp8_group_linear``) / scaled_mm) picks the Triton
    kernel where Triton runs; ``dense``: the reference's dequantised
    weight, kept by the caller. x may be ``Fp8Rows`` (``fp8_rows_linear``; then a W8A8 kernel
    runs: fp8_w8a8 when asked for, else scaled_mm)."""
    rows = isinstance(x, Fp8Rows)
    if on_triton(x.q if rows else x):
        return _triton[0]["fp8_linear"].fp8_linear(x, weight, weight_scale, input_scale, bias,
                                                   kernel=kernel)
    if rows:
        return reference_quant.fp8_rows_linear(x, weight, weight_scale, bias, dense=dense)
    return reference_quant.fp8_linear(x, weight, weight_scale, input_scale, bias, dense=dense)


def wna16_linear(x, qweight, scales, zeros, g_idx, perm, bits, group_size, bias=None, kernel=None,
                 tiled=None):
    """headrace.kernels.reference_quant.wna16_linear's semantics; ``kernel`` (triton_skinny /
    triton_tiled, on ``tiled``: the weight's ``triton_w4a16_tiled.pack_tiled`` layout / triton)
    picks the Triton kernel where Triton runs."""
    if on_triton(x):
        return _triton[0]["wna16_linear"].wna16_linear(x, qweight, scales, zeros, g_idx, perm,
                                                       bits, group_size, bias, kernel=kernel,
                                                       tiled=tiled)
    return reference_quant.wna16_linear(x, qweight, scales, zeros, g_idx, perm, bits, group_size,
                                        bias)


def fp8_linear_kernel(rows: int, device: str | torch.device = "cuda",
                      shape: tuple[int, int] | None = None, backend: str = "auto") -> str:
    """Which kernel ``fp8_linear`` runs for an input of ``rows`` rows on ``device``: 'reference', or
    on the GPU the default by rows ('fp8_skinny' / 'scaled_mm'), or with an [N, K] ``shape`` what a
    layer of that shape dispatches to (``headrace.kernels.quant_dispatch``, the libraries installed
    here)."""
    if not on_triton(device):
        return "reference"
    if shape is None:
        return _triton[0]["fp8_linear"].fp8_kernel(rows)
    from headrace.kernels import quant_dispatch, quant_libs
    n, k = shape
    return quant_dispatch.plan("fp8", n, k, backend, lambda name: quant_libs.takes(
        name, scheme="fp8", n=n, k=k, dtype=torch.bfloat16),
        max_layouts=quant_dispatch.layout_budget()).kernel(rows)


def wna16_linear_kernel(rows: int, device: str | torch.device = "cuda",
                        shape: tuple[int, int] | None = None, bits: int = 4, group_size: int = 128,
                        backend: str = "auto") -> str:
    """As ``fp8_linear_kernel`` for the integer-weight layers (bfloat16 inputs)."""
    if not on_triton(device):
        return "reference"
    quant = _triton[0]["wna16_linear"]
    n, k = shape or (0, group_size)
    if shape is None:
        return quant.wna16_kernel(rows, bits, group_size, k)
    from headrace.kernels import quant_dispatch, quant_libs, triton_w4a16, triton_w4a16_tiled

    def takes(name: str) -> bool:
        if name == "triton_skinny":
            return triton_w4a16.supports(bits, group_size, k)
        if name == "triton_tiled":
            return triton_w4a16_tiled.supports(bits, group_size, n, k)
        return quant_libs.takes(name, scheme="wna16", n=n, k=k, dtype=torch.bfloat16, bits=bits,
                                group_size=group_size)
    return quant_dispatch.plan(f"w{bits}a16", n, k, backend, takes,
                               max_layouts=quant_dispatch.layout_budget()).kernel(rows)
