"""Probe (GPU only, not a test): split-K GEMMs for Qwen3-0.6B's decode projections at W1's batch
sizes. cuBLAS leaves the short-N projections (o, down: N = 1024) with a few dozen tiles on 132
SMs, each looping over all of K. Here each program takes one share of K and writes float32
partials [S, M, N]; for o and down the consumer (the residual add + RMSNorm that follows them)
sums the partials as it loads them, so the pair is timed against cuBLAS + fused_add_rms_norm.
Each timed graph cycles through 12 distinct weights, so they come from HBM as in a decode step.

    python -P bench/splitk_probe.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from graph_timing import graph_ms
from kernels import triton_ops

SHAPES = {"o": (1024, 2048), "down": (1024, 3072), "qkv": (4096, 1024), "gate_up": (6144, 1024)}
COPIES = 12


@triton.jit
def _splitk_kernel(X, W, PART, M, N, k_per_split, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    lo = split * k_per_split
    for k0 in range(lo, lo + k_per_split, BLOCK_K):
        a = tl.load(X + rows[:, None] * stride_xm + (k0 + k)[None, :], mask=rows[:, None] < M,
                    other=0.0)
        b = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + (k0 + k)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(PART + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=rows[:, None] < M)


@triton.jit
def _sum_add_rms_kernel(PART, R, W, OUT, RES_OUT, M, N, eps, SPLITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        x += tl.load(PART + (s * M + row) * N + cols, mask=mask, other=0.0)
    r = tl.load(R + row * N + cols, mask=mask, other=0.0)
    x = (x.to(RES_OUT.dtype.element_ty).to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
    tl.store(RES_OUT + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (h * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty), mask=mask)


def main() -> None:
    dev = torch.device("cuda")
    tiles = list(itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (3, 4)))
    print("shape    rows  cublas(+norm)_us  best_splitk(+sum-norm)_us  (bm,bn,bk,stages,splits)")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(COPIES)]
        paired = n == 1024   # o and down: the add + RMSNorm after them sums the partials
        for m in (64, 128, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            res = torch.randn(m, n, dtype=torch.bfloat16, device=dev)
            nw = torch.rand(n, dtype=torch.bfloat16, device=dev)
            ref = torch.nn.functional.linear(x, weights[0]).float()

            def base(w):
                y = torch.nn.functional.linear(x, w)
                if paired:
                    triton_ops.fused_add_rms_norm(y, res, nw, 1e-6)
            t_base = 1e3 * graph_ms([lambda w=w: base(w) for w in weights])
            best = (float("inf"), None)
            for (bm, bn, bk, stages), splits in itertools.product(tiles, (1, 2, 4, 8)):
                if (k // splits) % bk or bm > m:
                    continue
                part = torch.empty(splits, m, n, dtype=torch.float32, device=dev)
                out, res_out = torch.empty_like(res), torch.empty_like(res)

                def call(w, bm=bm, bn=bn, bk=bk, ns=stages, s=splits, part=part, out=out,
                         res_out=res_out):
                    _splitk_kernel[(triton.cdiv(m, bm), n // bn, s)](
                        x, w, part, m, n, k // s, x.stride(0), w.stride(0), BLOCK_M=bm,
                        BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=ns)
                    if paired:
                        _sum_add_rms_kernel[(m,)](part, res, nw, out, res_out, m, n, 1e-6,
                                                  SPLITS=s, BLOCK=n, num_warps=4)
                try:
                    call(weights[0])
                    torch.cuda.synchronize()
                    if not torch.allclose(part.sum(0), ref, atol=0.5, rtol=2e-2):
                        print(name, m, (bm, bn, bk, stages, splits), "WRONG")
                        continue
                    t = 1e3 * graph_ms([lambda w=w: call(w) for w in weights])
                except Exception:  # noqa: BLE001 - out of shared memory
                    continue
                best = min(best, (t, (bm, bn, bk, stages, splits)))
            print(f"{name:8s} {m:4d} {t_base:16.2f} {best[0]:26.2f}  {best[1]}", flush=True)


if __name__ == "__main__":
    main()
