"""Accuracy of the quantized schemes on the GPU's kernels (issue 32): the embedded model's
held-out perplexity and greedy agreement, as ``tests/test_quant_accuracy.py`` measures them on
the CPU's plain-torch reference, but in bfloat16 on CUDA through the kernels a served model
runs (one-row decode GEMMs: the packed INT4 program, FP8 W8A16; prefill: the table's kernels;
Triton attention, FP8 KV where the scheme has it).

Why: the CPU table bounds the formats; the GPU's kernels round differently (bfloat16
activations, the packed INT4 program's bfloat16 products, FP8 KV's float16 widening), and
only this run prices that. Greedy agreement is against the CPU float32 model's tokens (the
test's baseline) and, in the last column, against the GPU's own unquantised bfloat16 model.

    python -m bench.quant_accuracy_gpu [--schemes NAME,...]     (~1 min on an H200)
    python -m bench.quant_accuracy_gpu --device cpu             (float32: the test's figures)
"""

from __future__ import annotations

import argparse

import torch

from headrace.dataplane.config import load_model_config
from headrace.dataplane.loader import load_model
from headrace.dataplane.quantization import resolve
from tests import test_quant_accuracy as acc


def load(kind: str, device: torch.device, dtype: torch.dtype):
    """The accuracy test's checkpoint of ``kind`` on ``device`` in ``dtype``."""
    src, method = acc.checkpoint(kind)
    return load_model(src, load_model_config(src), device, dtype, 1024, None, resolve(src, method))


def measure(model, kv: torch.dtype, device: torch.device, prompts) -> tuple[float, list]:
    """(held-out perplexity, each prompt's greedy tokens), as the test measures them."""
    return (acc.perplexity(model, kv, device),
            [acc.greedy(model, p, kv, device) for p in prompts])


def agreement(tokens: list[list[int]], baseline: list[list[int]]) -> float:
    """The share of tokens equal to the baseline's before each prompt's first divergence."""
    return sum(acc._agreement(t, b) for t, b in zip(tokens, baseline)) / (len(tokens) * acc.NEW)


def table(schemes: list[str], device: torch.device, dtype: torch.dtype) -> list[tuple]:
    """(scheme, perplexity, ratio to the unquantised model here, agreement with the CPU float32
    model, agreement with the unquantised model here) per scheme."""
    _, prompts = acc.held_out()
    cpu_tokens = [acc._float_greedy(tuple(p)) for p in prompts]
    base_ppl, base_tokens = measure(load("float", device, dtype), dtype, device, prompts)
    rows = []
    for name in schemes:
        kind, kv = acc.SCHEMES[name]
        ppl, tokens = measure(load(kind, device, dtype), dtype if kv == torch.float32 else kv,
                              device, prompts)
        rows.append((name, ppl, ppl / base_ppl, agreement(tokens, cpu_tokens),
                     agreement(tokens, base_tokens)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(n for n in acc.SCHEMES
                                                  if n not in acc.WEIGHT_ONLY_FP8))
    ap.add_argument("--device", default="cuda", help="cpu: float32, the test's reference path")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"| scheme ({device.type}, {str(dtype)[6:]}) | held-out perplexity | vs unquantised | "
          "greedy agreement vs CPU float32 | vs unquantised |")
    print("|---|---|---|---|---|")
    for name, ppl, ratio, a_cpu, a_here in table(args.schemes.split(","), device, dtype):
        print(f"| {name} | {ppl:.3f} | {ratio:.4f} | {a_cpu:.1%} | {a_here:.1%} |", flush=True)


if __name__ == "__main__":
    main()
