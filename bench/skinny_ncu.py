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

``--tile`` is BLOCK_M/BLOCK_N/warps/stages/split[/BLOCK_K] (the pinned or fixed tile when left out;
BLOCK_M 1: the one-row pipelined FMA program). ``--scheme w8a8`` is the W8A8 program on rows
quantised before it (as the norm and SiLU kernels hand them), ``w8a8i`` the one quantising its rows
itself (``headrace.kernels.triton_fp8_w8a8_inline``), ``w4a16t`` the INT4 program on the tiled
layout (``headrace.kernels.triton_w4a16_tiled``, whose kernel ncu finds as ``_tiled_kernel``).
``--calls`` eager launches (a profiler's), then the time per call replayed from a CUDA graph over >=
256 MB of weight copies.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels import graph_ms
from bench.quant_kernels import SHAPES, _caller, copies
from headrace.kernels import triton_fp8_w8a8, triton_quant, triton_w4a16
from headrace.kernels.skinny_gemm import Tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=["w4a16", "w4a16t", "fp8", "w8a8", "w8a8i"],
                    default="w4a16")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qkv")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--tile", default=None, help="BLOCK_M/BLOCK_N/warps/stages/split")
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    n, k = SHAPES[args.shape]
    tile = None
    if args.tile:
        bm, bn, warps, stages, split, *block_k = map(int, args.tile.split("/"))
        block_k = block_k or [triton_w4a16.BLOCK_K if args.scheme.startswith("w4a16") else 128]
        tile = Tile(bm, bn, block_k[0], warps, stages, split, dot=bm > 1, pipe=bm == 1)
    scheme = "w4a16" if args.scheme.startswith("w4a16") else "fp8"
    weights = copies(scheme, n, k)          # >= 256 MB: past the L2
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    if args.scheme == "w8a8":
        rows = triton_quant.per_token_fp8(x)
        calls = [lambda _, w=w: triton_fp8_w8a8.w8a8_linear(*rows, *w, tile=tile)
                 for w in weights]
    else:
        kernel = {"w4a16": "triton_skinny", "w4a16t": "triton_tiled", "fp8": "fp8_skinny",
                  "w8a8i": "fp8_w8a8_inline"}[args.scheme]
        calls = [_caller(scheme, kernel, w, tile) for w in weights]
    for i in range(args.calls):         # eager launches: the ones a profiler catches
        calls[i % len(calls)](x)
    torch.cuda.synchronize()
    us = graph_ms([lambda c=c: c(x) for c in calls]) * 1000
    print(f"{args.scheme} {args.shape} M={args.m} tile {args.tile or 'pinned'}: {us:.1f} us a "
          f"call (CUDA-graph replay over {len(weights)} weight copies)", flush=True)


if __name__ == "__main__":
    main()
