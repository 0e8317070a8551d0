"""``--deterministic``: the switch that makes every kernel the model calls batch-invariant (a
row's result independent of the other rows, the batch size, the chunk a prompt is split into,
and whether a row is a prefill or a decode), and what the mode refuses.

``enable(True)`` (the worker, once, before it loads the model) rebinds ``kernels.linear``,
``kernels.paged_attention`` and ``kernels.unified_attention`` to their batch-invariant twins:
``headrace.kernels.triton_invariant_gemm`` / ``headrace.kernels.triton_invariant_attention`` where the Triton
kernels run (``kernels.on_triton``), ``headrace.kernels.reference_invariant`` elsewhere (CPU, which also
takes ``silu_and_mul`` and the sampler's noise from there: torch's CPU exponentials round by
where an element sits, see that module); the LM head goes through ``kernels.linear`` too
(``headrace.dataplane.model.CausalLM.logits`` asks ``ENABLED``). The other kernels on the step path are
row-wise already, alike in both modes: RMSNorm and the fused add-norm (one program a row), the
q/k-norm + rotary + KV-write prologue (one program a token), Triton's SiLU, the embedding, the
sampler's race (one row's logits, its own counter-based noise) and the filters (row-wise torch
ops; the sort is stable). One mode per process: the
functions are module attributes, as ``HEADRACE_KERNELS``' choice is.

Refused in this mode, with a message saying so (``check``): quantized weights (their skinny
GEMMs pick tiles and K splits by row count, their library kernels by their own heuristics) and
flash-attn-4 (its split and tile choices are its own); ``--attention-backend auto`` resolves to
the Triton kernels.
"""

from __future__ import annotations

import contextlib

ENABLED = False
NAMES = ("linear", "paged_attention", "unified_attention", "silu_and_mul")
_saved: dict = {}


def _twins() -> dict:
    """The batch-invariant functions under the names ``kernels`` exports."""
    from headrace import kernels
    from headrace.kernels import reference_invariant

    def reference_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                            flash=None, out=None, k_scale=1.0, v_scale=1.0, **hints):
        result = reference_invariant.paged_attention(query, kv_cache, query_start_loc, seq_lens,
                                                     block_tables, scale, k_scale, v_scale)
        return result if out is None else out.copy_(result)

    def reference_unified(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                          k_scale=1.0, v_scale=1.0, out=None):
        import torch

        result = reference_invariant.paged_attention(query, kv_cache, query_start_loc, seq_lens,
                                                     block_tables, scale, k_scale, v_scale)
        if out is None:
            return result
        real = torch.arange(query.shape[0], device=query.device) < query_start_loc[-1]
        return out.copy_(torch.where(real[:, None, None], result, out))

    slow = {"linear": reference_invariant.linear, "paged_attention": reference_attention,
            "unified_attention": reference_unified,
            "silu_and_mul": reference_invariant.silu_and_mul}
    if kernels._triton is None:
        return slow
    from headrace.kernels import triton_invariant_attention, triton_invariant_gemm
    triton_ops = kernels._triton[1]

    def triton_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, *,
                         flash=None, out=None, **hints):
        hints.pop("num_kv_splits", None)
        return triton_invariant_attention.paged_attention(query, kv_cache, query_start_loc,
                                                          seq_lens, block_tables, scale, out=out,
                                                          **hints)

    fast = {"linear": triton_invariant_gemm.linear, "paged_attention": triton_attention,
            "unified_attention": triton_invariant_attention.unified_attention,
            "silu_and_mul": triton_ops.silu_and_mul}   # one program a row: row-wise already
    if kernels.MODE == "triton":
        return fast
    return {name: kernels._on_cuda(fast[name], slow[name]) for name in NAMES}


def enable(on: bool = True) -> None:
    """Batch-invariant kernels (True) or the default ones (False) from now on, process-wide."""
    global ENABLED
    from headrace import kernels

    if on == ENABLED:
        return
    if on:
        _saved.update({name: getattr(kernels, name) for name in NAMES})
        for name, fn in _twins().items():
            setattr(kernels, name, fn)
    else:
        for name in NAMES:
            setattr(kernels, name, _saved.pop(name))
    ENABLED = on


@contextlib.contextmanager
def enabled(on: bool = True):
    """``enable(on)`` for a block (tests), the mode before restored after it."""
    before = ENABLED
    enable(on)
    try:
        yield
    finally:
        enable(before)


def check(*, quantization: str | None, attention_backend: str, lora: bool = False) -> None:
    """ValueError (one line, naming the flag) for what ``--deterministic`` cannot serve."""
    if lora:
        raise ValueError("--deterministic: the LoRA update (--enable-lora) is not batch-invariant "
                         "(its shrink and expand kernels change with the step's token count); "
                         "serve adapters without --deterministic, or merge the adapter into the "
                         "weights")
    if quantization:
        raise ValueError(f"--deterministic: quantized weights ({quantization}) are not "
                         f"batch-invariant (their GEMMs choose tiles and K splits by batch size); "
                         f"serve the unquantized checkpoint, or drop --deterministic")
    if attention_backend == "flash-attn":
        raise ValueError("--deterministic: --attention-backend flash-attn is not batch-invariant "
                         "(flash-attn-4 chooses its own splits and tiles); use --attention-backend "
                         "auto or triton")
