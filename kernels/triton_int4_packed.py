"""The one-row W4A16 program on packed bfloat16 pairs: ``headrace.kernels.triton_w4a16``'s pipelined
FMA program for 4-bit GPTQ words and bfloat16 activations on the GPU (``PACKED``).

Why: at one row a 4-bit projection is bound by the instructions it issues per weight value,
not by its bytes (Nsight Compute, session 23: 0.68 instructions issued a cycle per scheduler,
near the bound; 335 warp instructions a 4 KB step, ~5 a value, at 1.9 TB/s on the H200 where
the copy rate is 4.3). The float32 program spends a shift, an and-or and an FMA on every value.
Here one word's eight values cost 18 instructions in PTX, two values an instruction where it
counts: four magic-number pairs (``(w >> 4i) & 0x000F000F | 0x43004300`` is the bfloat16 pair
128 + q of nibbles i and i + 4), less 128 + z by four ``sub.rn.bf16x2`` (exact: small
integers), multiplied by x's pairs (x_i, x_(i+4)) and summed by one ``mul`` and three
``fma.rn.bf16x2``, the two lanes widened and added in float32. The group's scale multiplies the
float32 sums once a step per column, as in the float32 program.

Precision: a product (q - z) x and the running sum of a word's four pairs round to bfloat16
(8 bits), a relative 2^-9 each, the size of the reference's own rounding of every dequantised
weight to bfloat16 (``reference_quant.wna16_linear``); words are added in float32. The CPU
interpreter cannot run PTX, so there the float32 program runs; the GPU tests check this one
against the reference (``tests/test_w4a16_skinny.py`` under HEADRACE_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _word_dot_asm(words, p0, p1, p2, p3, zz):
    """Each word's sum over its 8 values of (q - z) x in float32: ``p0..p3`` are x's bfloat16
    pairs (x_i, x_(i+4)) of the word's K values as int32, ``zz`` the pair (128 + z, 128 + z)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, t, a, lo, hi;
        .reg .f32 flo, fhi;
        lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 t, t, $6;
        mul.rn.bf16x2 a, t, $2;
        shr.u32 s, $1, 4;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 t, t, $6;
        fma.rn.bf16x2 a, t, $3, a;
        shr.u32 s, $1, 8;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 t, t, $6;
        fma.rn.bf16x2 a, t, $4, a;
        shr.u32 s, $1, 12;
        lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 t, t, $6;
        fma.rn.bf16x2 a, t, $5, a;
        shl.b32 lo, a, 16;
        and.b32 hi, a, 0xFFFF0000;
        mov.b32 flo, lo;
        mov.b32 fhi, hi;
        add.f32 $0, flo, fhi;
        }""",
        constraints="=f,r,r,r,r,r,r", args=[words, p0, p1, p2, p3, zz],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def fma_pipelined_packed(x_row, QW, S, Z, cols, N, K, GROUP, k_lo, k_hi, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, 1] of the bfloat16 row at ``x_row`` (4-byte aligned) over the K slice
    [k_lo, k_hi), 4-bit words [BLOCK_K / 8, BLOCK_N] a step (``cols`` inside N), the next
    step's words loaded before this step's are used (as ``triton_w4a16._fma_pipelined``)."""
    KW: tl.constexpr = BLOCK_K // 8
    c = cols[None, :]
    k_end = (K - 1) // BLOCK_K * BLOCK_K
    first = tl.minimum(k_lo, k_end)
    last = tl.minimum(k_lo + tl.maximum(k_hi - k_lo - 1, 0) // BLOCK_K * BLOCK_K, k_end) // 8
    kw_hi = k_hi // 8
    rk = tl.arange(0, KW)
    tile_at = QW + rk[:, None].to(tl.int64) * N + c
    if EVEN_K:
        words = tl.load(tile_at + (first // 8).to(tl.int64) * N)
    else:
        words = tl.load(tile_at + (first // 8).to(tl.int64) * N,
                        mask=(first // 8 + rk < kw_hi)[:, None], other=0)
    x_at = x_row.to(tl.pointer_type(tl.int32), bitcast=True) + rk * 4   # a word's 8 values
    acc = tl.zeros([KW, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        nxt = tl.minimum(k0 // 8 + KW, last)
        if EVEN_K:
            words_next = tl.load(tile_at + nxt.to(tl.int64) * N)
            x0 = tl.load(x_at + k0 // 2)
            x1 = tl.load(x_at + k0 // 2 + 1)
            x2 = tl.load(x_at + k0 // 2 + 2)
            x3 = tl.load(x_at + k0 // 2 + 3)
        else:
            words_next = tl.load(tile_at + nxt.to(tl.int64) * N,
                                 mask=(nxt + rk < kw_hi)[:, None], other=0)
            ok = k0 // 8 + rk < kw_hi
            x0 = tl.load(x_at + k0 // 2, mask=ok, other=0)
            x1 = tl.load(x_at + k0 // 2 + 1, mask=ok, other=0)
            x2 = tl.load(x_at + k0 // 2 + 2, mask=ok, other=0)
            x3 = tl.load(x_at + k0 // 2 + 3, mask=ok, other=0)
        # x's pairs (x_i, x_(i+4)) of each word's K values: low halves hold the first
        p0 = (x0 & 0xFFFF) | (x2 << 16)
        p1 = ((x0 >> 16) & 0xFFFF) | (x2 & -65536)
        p2 = (x1 & 0xFFFF) | (x3 << 16)
        p3 = ((x1 >> 16) & 0xFFFF) | (x3 & -65536)
        g = k0 // GROUP
        s = tl.load(S + g * N + cols).to(tl.float32)[None, :]                        # [1, BN]
        zz = (tl.load(Z + g * N + cols).to(tl.int32) | 0x4300) * 65537               # 128 + z, x2
        t = _word_dot_asm(words, tl.broadcast_to(p0[:, None], [KW, BLOCK_N]),
                          tl.broadcast_to(p1[:, None], [KW, BLOCK_N]),
                          tl.broadcast_to(p2[:, None], [KW, BLOCK_N]),
                          tl.broadcast_to(p3[:, None], [KW, BLOCK_N]),
                          tl.broadcast_to(zz[None, :], [KW, BLOCK_N]))
        acc += s * t
        words = words_next
    return tl.sum(acc, axis=0)[:, None]
