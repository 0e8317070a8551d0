"""Probe (GPU only, not a test): Qwen3-0.6B's decode projections at W1's batch sizes (64-256
rows), torch's GEMM (cuBLAS) against a plain Triton GEMM over a grid of tiles. Each timed
graph cycles through 12 distinct weights, so they come from HBM as in a real decode step.

    python -P bench/gemm_probe.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from graph_timing import graph_ms

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
COPIES = 12


@triton.jit
def _gemm_kernel(X, W, OUT, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(X + rows[:, None] * stride_xm + (k0 + k)[None, :], mask=rows[:, None] < M,
                    other=0.0)
        b = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + (k0 + k)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=rows[:, None] < M)


def main() -> None:
    dev = torch.device("cuda")
    configs = list(itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4, 6)))
    print("shape    rows  torch_us  best_triton_us  config(bm,bn,bk,warps,stages)  TFLOP/s(best)")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(COPIES)]
        for m in (64, 128, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            ref = torch.nn.functional.linear(x, weights[0])
            t_torch = 1e3 * graph_ms([lambda w=w: torch.nn.functional.linear(x, w)
                                      for w in weights])
            best = (float("inf"), None)
            for bm, bn, bk, warps, stages in configs:
                def call(w, bm=bm, bn=bn, bk=bk, nw=warps, ns=stages):
                    _gemm_kernel[(triton.cdiv(m, bm), n // bn)](
                        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                try:
                    call(weights[0])
                    torch.cuda.synchronize()
                    if not torch.allclose(out.float(), ref.float(), atol=0.5, rtol=2e-2):
                        print(name, m, (bm, bn, bk, warps, stages), "WRONG")
                        continue
                    t = 1e3 * graph_ms([lambda w=w: call(w) for w in weights])
                except Exception as exc:  # noqa: BLE001 - out of shared memory
                    continue
                best = min(best, (t, (bm, bn, bk, warps, stages)))
            tflops = 2 * m * n * k / best[0] / 1e6
            print(f"{name:8s} {m:4d} {t_torch:9.2f} {best[0]:15.2f}  {str(best[1]):30s} {tflops:8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
