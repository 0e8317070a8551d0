"""Times the skinny-input projection kernel against torch's GEMM on Qwen3-0.6B's decode
projections (batch 1-16), for a few tile configurations. Prints one line per case.

    python -P bench/linear_tune.py
"""

from __future__ import annotations

import itertools

import torch
import triton

from kernels import triton_linear

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def time_us(fn, reps: int = 200) -> float:
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    dev = torch.device("cuda")
    for rows in (1, 16):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
            w = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
            out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
            best = []
            for block_n, block_k, warps, stages in itertools.product((16, 32, 64), (128, 256),
                                                                     (4, 8), (3, 5)):
                def run(bn=block_n, bk=block_k, nw=warps, ns=stages):
                    triton_linear._skinny_kernel[(triton.cdiv(n, bn),)](
                        x, w, w, out, rows, n, k, x.stride(0), w.stride(0), out.stride(0),
                        HAS_BIAS=False, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32",
                        DOT_F32=False, num_warps=nw, num_stages=ns)
                try:
                    best.append((time_us(run), block_n, block_k, warps, stages))
                except Exception as exc:   # out of shared memory and the like
                    continue
            best.sort()
            torch_us = time_us(lambda: torch.nn.functional.linear(x, w))
            cur_us = time_us(lambda: triton_linear.linear(x, w))
            gb = n * k * 2 / 1e9
            print(f"M={rows:2d} {name:8s} torch {torch_us:6.2f} us  current {cur_us:6.2f} us  "
                  f"best {best[0][0]:6.2f} us ({gb / best[0][0] * 1e6:5.0f} GB/s) cfg {best[0][1:]}  "
                  f"next {[b[1:] for b in best[1:3]]}", flush=True)


if __name__ == "__main__":
    main()
