"""One skinny quantized GEMM (our W4A16 or FP8 Triton kernel) launched a few times at one
Llama-3.1-8B shape, row count and tile, over distinct weight copies: the program to run under
Nsight Compute when a tile reads its weights far under the copy bandwidth.

Why: ``bench.quant_kernels`` says how fast a tile is, ``bench.gemm_sass`` how many
instructions its K loop issues; neither says what its warps wait for. On the H200 (session 22)
the W4A16 tl.dot program at M = 16 read 0.5 TB/s with an issue bound of 2.9 TB/s, and the FP8
one, of the same structure, 1.7 TB/s. ncu's warp-state and scheduler sections name the stall.

    ncu --clock-control none -k regex:skinny --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python -m bench.skinny_ncu --scheme w4a16 --shape qkv --m 16 --tile 16/64/4/3/4

``--tile`` is BLOCK_M/BLOCK_N/warps/stages/split (the pinned or fixed tile when left out;
BLOCK_M 1: the one-row pipelined FMA program). ``--calls`` eager launches (a profiler's), then
the time per call replayed from a CUDA graph over >= 256 MB of weight copies.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels import graph_ms
from bench.quant_kernels import SHAPES, _caller, copies
from kernels import triton_w4a16
from kernels.skinny_gemm import Tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=["w4a16", "fp8"], default="w4a16")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qkv")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--tile", default=None, help="BLOCK_M/BLOCK_N/warps/stages/split")
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    n, k = SHAPES[args.shape]
    tile = None
    if args.tile:
        bm, bn, warps, stages, split = map(int, args.tile.split("/"))
        block_k = triton_w4a16.BLOCK_K if args.scheme == "w4a16" else 128
        tile = Tile(bm, bn, block_k, warps, stages, split, dot=bm > 1, pipe=bm == 1)
    weights = copies(args.scheme, n, k)          # >= 256 MB: past the L2
    kernel = "triton_skinny" if args.scheme == "w4a16" else "fp8_skinny"
    calls = [_caller(args.scheme, kernel, w, tile) for w in weights]
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    for i in range(args.calls):         # eager launches: the ones a profiler catches
        calls[i % len(calls)](x)
    torch.cuda.synchronize()
    us = graph_ms([lambda c=c: c(x) for c in calls]) * 1000
    print(f"{args.scheme} {args.shape} M={args.m} tile {args.tile or 'pinned'}: {us:.1f} us a "
          f"call (CUDA-graph replay over {len(weights)} weight copies)", flush=True)


if __name__ == "__main__":
    main()
