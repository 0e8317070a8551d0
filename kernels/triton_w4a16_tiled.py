"""Triton W4A16 GEMM at decode batch sizes on a tiled INT4 layout, where each thread's 32-bit word
holds exactly the eight values its tensor-core fragment takes: ``headrace.kernels.reference_quant.
wna16_linear``'s semantics for 4-bit weights in groups of a multiple of 128 columns.

Why: in the GPTQ layout (``qweight`` [K / 8, N], 8 values of K a word) a word's values belong to
four threads' MMA fragments, so the skinny kernel (``headrace.kernels.triton_w4a16``) reorders them
in registers or through shared memory every step: 332 warp instructions a 4 KB step of its 16 x 64
tile on SM90 (0.32 a byte), and Hopper's wgmma staged that operand through shared memory with 8-way
bank conflicts (session 22). Here the weight is repacked once (``pack_tiled``, as Marlin does for
its kernel) into blocks of 16 weight rows x 16 K values, 32 words a block, word (g, t) holding rows
g and g + 8 at K values 2t, 2t + 1, 2t + 8 and 2t + 9: the A operand of an m16 x k16 MMA in its own
register order. Nibbles i and i + 4 of a word are one bfloat16 pair of that operand (row 8 * (i % 2)
+ g, K 8 * (i // 2) + 2t and the next), so a pair costs one shift, one LOP3 (the magic number
0x4300: bfloat16 128 + q) and one bfloat16x2 subtraction of 128 + zero point, and nothing moves
between threads: wgmma takes the operand from registers. 217 warp instructions a 4 KB step at 16 x
64 on 4 warps (0.21 a byte; ``python -m bench.gemm_sass --schemes w4a16t``), no shared memory for
the weight. On the H200 at 16 rows it runs Llama-3.1-8B's projections at 0.71-0.82x of bf16's time,
against 0.76-0.90x for ``triton_skinny`` (session 25): with half the instructions it is no longer
issue-bound.

Each step lies in one group (the group's scale multiplies the step's float32
product per column, more exact than the reference's rounding of each dequantised weight), the
next step's words are loaded before the current ones are used, and K is split over programs
with the self-cleaning workspace where output tiles are few (``headrace.kernels.skinny_gemm``). The
unpacking is inline PTX on the GPU; under the CPU interpreter the same values come from
Triton's own shifts and masks. No host synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.skinny_gemm import (MAX_SPLIT, PROGRAMS_PER_SM, Tile, Tuner, activations,
                                          launch_args, program_slice, store_or_reduce)
from headrace.kernels.triton_flash import INTERPRETED

BLOCK_K = 128           # K values a step: one group of 128, 16 words a weight row
ROWS = 16               # weight rows (output columns) of a word block
ASM = tl.constexpr(not INTERPRETED)


def supports(bits: int, group_size: int, n: int, k: int) -> bool:
    """4-bit values, N in whole word blocks, K in whole steps, groups of a multiple of the step
    (or one group for all of K)."""
    return (bits == 4 and n % ROWS == 0 and k % BLOCK_K == 0 and group_size > 0
            and (group_size % BLOCK_K == 0 or group_size >= k))


def pack_tiled(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ 4-bit ``qweight`` [K / 8, N] int32 -> the tiled words [N / 16, K / 16, 8, 4] int32:
    word (nb, kb, g, t) nibble 4p + 2h + r is the value of row 16 nb + 8r + g at K value
    16 kb + 8h + 2t + p."""
    kw, n = qweight.shape
    k = kw * 8
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF           # [K / 8, 8, N]
    q = q.reshape(k, n).t().reshape(n // 16, 2, 8, k // 16, 2, 4, 2)  # nb r g kb h t p
    q = q.permute(0, 3, 2, 5, 6, 4, 1).reshape(n // 16, k // 16, 8, 4, 8)   # .. p h r
    word = (q.to(torch.int64) << shifts.to(torch.int64)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


@triton.jit
def _pairs_asm(wb, z0, z1):
    """wb [.., 2] int32 (each word twice), z0 / z1 [.., 2] bfloat16 (128 + the zero point of
    the word's rows r = 0 / 1): the word's four bfloat16 pairs (nibbles i, i + 4) less their
    row's 128 + z, one shift, LOP3 and subtraction a pair."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, t;
        lop3.b32 t, $4, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 $0, t, $6;
        shr.u32 s, $4, 4;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 $1, t, $7;
        shr.u32 s, $4, 8;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 $2, t, $6;
        shr.u32 s, $4, 12;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 $3, t, $7;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r", args=[wb, z0, z1],
        dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)


@triton.jit
def _operand(words, zrow, nb, cols_in, NB: tl.constexpr, BLOCK_N: tl.constexpr,
             USE_ASM: tl.constexpr, dtype: tl.constexpr):
    """words [NB, 8, 8, 4] of the word blocks ``nb`` -> the step's weight tile [BLOCK_N,
    BLOCK_K] less its zero points (``zrow``: Z's row of this group; ``cols_in`` the tile's
    rows), in the MMA operand's order (``pack_tiled``)."""
    if USE_ASM:
        shape: tl.constexpr = [NB, 8, 8, 4, 2]
        n0 = (nb[:, None] * 16 + tl.arange(0, 8)[None, :])[:, None, :, None, None]   # r = 0
        z0 = (tl.load(zrow + n0).to(tl.float32) + 128.0).to(tl.bfloat16)
        z1 = (tl.load(zrow + n0 + 8).to(tl.float32) + 128.0).to(tl.bfloat16)
        v0, v1, v2, v3 = _pairs_asm(tl.broadcast_to(words[:, :, :, :, None], shape),
                                    tl.broadcast_to(z0, shape), tl.broadcast_to(z1, shape))
        q = tl.join(tl.join(v0, v1), tl.join(v2, v3))                 # [nb kb g t p r h]
        q = tl.permute(q, (0, 5, 2, 1, 6, 3, 4))                       # [nb r g kb h t p]
        return tl.reshape(q, [BLOCK_N, 128])
    v = tl.join(tl.join(words & 0xF, (words >> 4) & 0xF),
                tl.join((words >> 8) & 0xF, (words >> 12) & 0xF))     # [nb kb g t r h]
    v = tl.join(v, tl.join(tl.join((words >> 16) & 0xF, (words >> 20) & 0xF),
                           tl.join((words >> 24) & 0xF, (words >> 28) & 0xF)))   # .. p
    q = tl.reshape(tl.permute(v, (0, 4, 2, 1, 5, 3, 6)), [BLOCK_N, 128])   # [nb r g kb h t p]
    z = tl.load(zrow + cols_in).to(tl.float32)
    return (q.to(tl.float32) - z[:, None]).to(dtype)                  # exact: small integers


@triton.jit(do_not_specialize=["M_BUCKET"])
def _tiled_kernel(X, QW, S, Z, B, OUT, WS, CNT, M, N, K, stride_xm, stride_om, M_BUCKET,
                  SPLIT_K, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
                  DOT_F32: tl.constexpr, PIPE: tl.constexpr = False,
                  EVEN_N: tl.constexpr = False):
    tl.static_assert(BLOCK_K == 128)
    NB: tl.constexpr = BLOCK_N // 16
    rows, cols, k_lo, k_hi = program_slice(K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    rows_in = tl.minimum(rows, M - 1)
    # blocks past N read the last one (never stored): no masks in the loop
    nb = tl.program_id(1) * NB + tl.arange(0, NB)
    cols_in = cols
    if not EVEN_N:
        nb = tl.minimum(nb, N // 16 - 1)
        cols_in = tl.minimum(cols, N - 16 + cols % 16)
    dtype = X.dtype.element_ty
    kb, g, t = tl.arange(0, 8), tl.arange(0, 8), tl.arange(0, 4)
    w_at = QW + ((nb[:, None, None, None].to(tl.int64) * (K // 16) + kb[None, :, None, None]) * 32
                 + g[None, None, :, None] * 4 + t[None, None, None, :])
    x_at = X + rows_in[None, :].to(tl.int64) * stride_xm + tl.arange(0, BLOCK_K)[:, None]
    # the slice's first and last steps, both inside K (an empty slice past K loads the last
    # step and adds nothing); the next step's words load before this step's are used (two or
    # three steps ahead measured 5-30% slower on the H200: with a second loop-carried tile of
    # words Triton stops pipelining x's loads through asynchronous copies)
    k_end = K - BLOCK_K
    last = tl.minimum(k_lo + tl.maximum(k_hi - k_lo - 1, 0) // BLOCK_K * BLOCK_K, k_end)
    words = tl.load(w_at + tl.minimum(k_lo, k_end) // 16 * 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words_next = tl.load(w_at + tl.minimum(k0 + BLOCK_K, last) // 16 * 32)
        zrow = Z + (k0 // GROUP) * N
        q = _operand(words, zrow, nb, cols_in, NB, BLOCK_N,
                     ASM and not DOT_F32 and dtype == tl.bfloat16, dtype)
        xt = tl.load(x_at + k0)                                          # [BK, BM]
        if DOT_F32 or dtype == tl.float32:
            t_ = tl.dot(q.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            t_ = tl.dot(q, xt)
        s = tl.load(S + (k0 // GROUP) * N + cols_in).to(tl.float32)
        acc += s[:, None] * t_
        words = words_next
    store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, 0, B,
                    HAS_BIAS, SPLIT_K, False)


def _dot(m: int, n: int, warps: int = 4, split: int = 1, stages: int = 3) -> Tile:
    return Tile(m, n, BLOCK_K, warps, stages, split)


# Candidate tiles per row bucket, the fixed (first) one then the sweep's: 64 weight rows a
# program on 4 warps is what takes wgmma's register operand (below 64 Triton takes the Ampere
# MMA, which this layout also feeds, but its x operand then takes shared-memory round trips).
_SMALL = [_dot(16, 64), _dot(16, 64, 4, 2), _dot(16, 64, 4, 4), _dot(16, 64, 4, 8),
          _dot(16, 64, 4, 1, 4), _dot(16, 64, 4, 4, 4), _dot(16, 128, 8), _dot(16, 128, 8, 2),
          _dot(16, 128, 8, 4), _dot(16, 64, 4, 2, 2), _dot(16, 64, 4, 4, 2), _dot(16, 64, 4, 16)]
TILES = {1: _SMALL, 2: _SMALL, 4: _SMALL, 8: _SMALL, 16: _SMALL,
         32: [_dot(32, 64), _dot(32, 64, 4, 2), _dot(32, 64, 4, 4), _dot(32, 128, 8),
              _dot(32, 128, 8, 2), _dot(32, 64, 4, 8), _dot(32, 64, 4, 4, 4)],
         64: [_dot(64, 64), _dot(64, 64, 4, 2), _dot(64, 64, 4, 4), _dot(64, 128, 8),
              _dot(64, 128, 8, 2), _dot(64, 64, 4, 8), _dot(64, 64, 4, 4, 4)],
         128: [_dot(128, 64), _dot(128, 64, 4, 2), _dot(128, 128, 8), _dot(64, 64, 4, 2)]}
TILES[256] = TILES[128]
if INTERPRETED:
    TILES = {b: ts[:1] for b, ts in TILES.items()}

TUNER = Tuner(triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0})(_tiled_kernel),
              TILES, fits=lambda tile, args: tile.block_k == BLOCK_K and tile.block_n % ROWS == 0,
              split_limits=lambda tile: (PROGRAMS_PER_SM, MAX_SPLIT))


def w4a16_tiled_linear(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """``reference_quant.wna16_linear`` for 4-bit weights repacked by ``pack_tiled`` (``tiled``
    [N / 16, K / 16, 8, 4]); scales and zeros [G, N] as GPTQ's; ``tile``: one launch
    configuration instead of the pinned or fixed one (tests, the bench's sweep)."""
    nb, kb = tiled.shape[:2]
    n, k = nb * ROWS, kb * 16
    if not supports(4, group_size, n, k):
        raise ValueError(f"the tiled INT4 kernel takes N in blocks of {ROWS}, K in steps of "
                         f"{BLOCK_K} and groups of a multiple of {BLOCK_K}, not N = {n}, K = {k}, "
                         f"groups of {group_size}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    x2 = activations(x, k, perm)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        args = launch_args(x2, out)
        args.update(X=x2, QW=tiled, S=scales, Z=zeros, B=tiled if bias is None else bias, K=k,
                    GROUP=min(group_size, k), HAS_BIAS=bias is not None)
        TUNER(x2.shape[0], n, args, (args["M_BUCKET"], n, k, x.dtype, bias is not None), tile,
              scheme="triton_tiled")
    return out.reshape(*x.shape[:-1], n)
