"""The skinny W8A8 GEMM that quantises its activations itself: ``headrace.kernels.reference_quant.
fp8_group_linear``'s semantics (e4m3 weight with per-row or one scale; x quantised to e4m3 per
token and 128-column group, in the GEMM's own K loop).

Why: an FP8 layer whose rows nobody quantised for it (o_proj: its rows come from attention)
paid a separate quantiser launch before ``headrace.kernels.triton_fp8_w8a8``'s GEMM: ~2.5 us on the
H200 (session 24), a fifth of bf16's whole o_proj at 16 rows (12.6 us). Here each program
loads its rows' [BLOCK_K = 128, BLOCK_M] tile of x in their own dtype with the weight's tile,
rounds it to e4m3 with one scale per row (that tile's max |x| / 448), and adds the FP8 tensor
cores' product times those scales to its float32 sums. One scale per 128 columns instead of one
per row is finer, so the activations' rounding error is at most the per-token quantiser's.
Every program of a row tile quantises the same x again: N / BLOCK_N times over, which is cheap
while x is small beside the weight (M << BLOCK_N) and is why the bench ranks this kernel per
row count rather than everywhere (SM90 machine code, ``python -m bench.gemm_sass --schemes
w8a8i``: 230 warp instructions a 16 x 64 step against 65 on quantised rows, 739 at 64 rows).

The program is ``triton_fp8_w8a8._w8a8_skinny_kernel`` with ``QUANT_X``; its tiles (128
columns a step only: the quantisation group) are pinned under the ``fp8_w8a8_inline`` key
of kernels/quant_dispatch.json. No host synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton

from headrace.kernels.skinny_gemm import MAX_SPLIT, Tile, Tuner, activations, launch_args
from headrace.kernels.triton_flash import INTERPRETED
from headrace.kernels.triton_fp8_w8a8 import GROUP, W8A8_PROGRAMS_PER_SM, _w8a8_skinny_kernel


def _tile(m: int, n: int, warps: int = 4, stages: int = 4, split: int = 1) -> Tile:
    return Tile(m, n, GROUP.value, warps, stages, split)


def _bucket(m: int, wide: int) -> list[Tile]:
    """A row bucket's candidates: the fixed (first) tile, then the sweep's."""
    return [_tile(m, 64), _tile(m, 64, 4, 4, 2), _tile(m, 64, 4, 4, 4), _tile(m, 64, 4, 5, 2),
            _tile(m, 64, 4, 5, 4), _tile(m, 128, wide), _tile(m, 128, wide, 4, 2),
            _tile(m, 128, 8, 4, 4), _tile(m, 64, 4, 3, 8), _tile(m, 64, 8, 4, 4),
            _tile(m, 64, 4, 6, 4)]


# (16-32 columns a program, mma.sync on widened operands, were 1.3-3x slower on the H200 than
# these at 1-16 rows in session 25's sweep)
_SMALL = _bucket(16, 4)
TILES = {1: _SMALL, 2: _SMALL, 4: _SMALL, 8: _SMALL, 16: _SMALL, 32: _bucket(32, 4),
         64: _bucket(64, 8), 128: [_tile(128, 128, 8, 3), _tile(64, 128, 8, 4),
                                   _tile(128, 64, 4, 4), _tile(128, 128, 8, 3, 2)]}
TILES[256] = TILES[128]
if INTERPRETED:
    TILES = {b: ts[:1] for b, ts in TILES.items()}

TUNER = Tuner(triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
                                  "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(
    _w8a8_skinny_kernel), TILES, fits=lambda tile, args: tile.block_k == GROUP.value,
    split_limits=lambda tile: (W8A8_PROGRAMS_PER_SM, MAX_SPLIT))   # a pinned tile of another
# BLOCK_K (a hand-edited table) is passed over for the fixed one


def w8a8_inline_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """x [..., K] (bfloat16, float16 or float32) quantised per token and 128 columns, @
    (weight [N, K] e4m3 * weight_scale: float32 [N] or one element)^T + bias, in x's dtype.
    ``tile``: one launch configuration instead of the pinned or fixed one (tests, the bench's
    sweep); its BLOCK_K must be 128."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    if tile is not None and tile.block_k != GROUP.value:
        raise ValueError(f"tile {tile.as_list()}: the inline quantiser needs BLOCK_K = "
                         f"{GROUP.value} (its group)")
    scale = weight_scale.reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"scales: {scale.numel()} for {n} columns (want 1 or {n})")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    x2 = activations(x, k)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        args = launch_args(x2, out)
        args.update(X=x2, SX=scale, W=weight, S=scale, B=weight if bias is None else bias, K=k,
                    stride_wn=weight.stride(0),
                    stride_s=0 if scale.numel() == 1 else scale.stride(0),
                    HAS_BIAS=bias is not None, DOT_F32=INTERPRETED, PRECISION="ieee",
                    QUANT_X=True)
        key = (args["M_BUCKET"], n, k, x.dtype, bias is not None, scale.numel() == 1)
        TUNER(x2.shape[0], n, args, key, tile, scheme="fp8_w8a8_inline")
    return out.reshape(*x.shape[:-1], n)
