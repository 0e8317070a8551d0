"""Probe (GPU only, not a test): Qwen3-0.6B's four decode projections through torch's GEMMs,
28 layers of distinct weights replayed from a CUDA graph, under each BLAS back end torch offers
(cuBLAS, cuBLASLt). The cuBLAS(Lt) workspace (which split-K algorithms need) is read from the
environment at start-up, so compare runs with CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE
set differently.

    python -P bench/blas_probe.py
"""

from __future__ import annotations

import torch

from graph_timing import graph_ms

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    weights = {name: [torch.randn(n, k, dtype=bf, device=dev) * 0.03 for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    print("library  rows  " + "  ".join(f"{n:>7}" for n in SHAPES) + "   chain (us per layer)")
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for m in (8, 32, 64, 128, 256):
            cells = []
            for name, (_, k) in SHAPES.items():
                x = torch.randn(m, k, dtype=bf, device=dev)
                cells.append(1e3 * graph_ms([lambda w=w, x=x: torch.nn.functional.linear(x, w)
                                             for w in weights[name]]))
            xs = {name: torch.randn(m, k, dtype=bf, device=dev) for name, (_, k) in SHAPES.items()}

            def layer(i, xs=xs):
                for name in SHAPES:
                    torch.nn.functional.linear(xs[name], weights[name][i])
            chain = 1e3 * graph_ms([lambda i=i: layer(i) for i in range(LAYERS)])
            print(f"{library:8s} {m:5d}  " + "  ".join(f"{c:7.2f}" for c in cells)
                  + f"   {chain:7.2f}", flush=True)


if __name__ == "__main__":
    main()
