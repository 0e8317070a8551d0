"""4-bit GPTQ words as the tensor cores' operand: one BLOCK_K step of the W4A16 skinny kernel's
tl.dot program (``headrace.kernels.triton_w4a16``), unpacked, zero points subtracted, multiplied by
x.

Why: a decode GEMM over INT4 weights is bound by its weight bytes only if turning 4-bit
values into the MMA's 16-bit operand costs fewer instructions than the SM can issue while the
bytes arrive. Converting each value (shift, mask, int-to-float at a quarter of the FMA rate)
and folding the zero point through a per-tile ``sum(x)`` took 670 warp instructions a 4 KB step
on SM90, capping the kernel at 1.6 TB/s (session 21, ``bench.gemm_sass``). Here two values
cost a shift and an and-or (a magic-number bfloat16 pair), the zero point an exact subtraction
in x's dtype: 370, or 331 with the unpacking written in PTX (``unpack_int4_bf16_asm``, off by
default, ``HEADRACE_W4A16_ASM=1``). Which MMA runs the step is the tile's choice: below 64
weight rows a program takes the Ampere MMA, whose operand these registers feed directly
(session 22: Hopper's wgmma staged it through shared memory with 8-way bank conflicts).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_step_int4(words, z, xt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_F32: tl.constexpr, ASM: tl.constexpr):
    """One BLOCK_K step of the tl.dot program on 4-bit words [BLOCK_N, BLOCK_K / 8] with zero
    points z [BLOCK_N] (float32) and the step's activations xt [BLOCK_K, BLOCK_M]:
    t [BLOCK_N, BLOCK_M] = sum_k (q_kn - z_n) x_mk in float32.

    Unpacking costs one shift and one and-or per two values: (w >> 4i) & 0x000F000F |
    0x43004300 holds the bfloat16 pair (128 + q_i, 128 + q_(i+4)) (0x4300 is 128.0, whose last
    mantissa bit is worth 1; float16's is 0x6400, 1024.0), with no int-to-float conversion.
    Subtracting 128 + z in the activations' dtype is exact (small integers), so the zero point
    costs one subtraction a value and no sum of x. The pairs are put back in K order in
    registers (byte permutes) so that x is read as it lies, by the pipeline's async copies."""
    half: tl.constexpr = xt.dtype == tl.float16
    if half:
        magic = 0x64006400                               # float16 1024.0, twice
        zq = (z + 1024.0).to(tl.float16)
    else:
        magic = 0x43004300                               # bfloat16 128.0, twice
        zq = (z + 128.0).to(tl.bfloat16)
    sub_asm: tl.constexpr = ASM and not half and not DOT_F32 and xt.dtype == tl.bfloat16
    if sub_asm:
        q = unpack_int4_bf16_asm(words, zq, BLOCK_N, BLOCK_K)
    else:
        v0 = (words & 0x000F000F) | magic
        v1 = ((words >> 4) & 0x000F000F) | magic
        v2 = ((words >> 8) & 0x000F000F) | magic
        v3 = ((words >> 12) & 0x000F000F) | magic
        v = tl.join(tl.join(v0, v1), tl.join(v2, v3))                  # [BN, KW, 2, 2]: i
        q = tl.join(v.to(tl.int16), (v >> 16).to(tl.int16))            # value i + 4 * last
        q = tl.permute(q, (0, 1, 4, 3, 2))                              # [BN, KW, 8] in K order
        if half:
            q = q.to(tl.float16, bitcast=True)
        else:
            q = q.to(tl.bfloat16, bitcast=True)
        q = tl.reshape(q, [BLOCK_N, BLOCK_K])
    if DOT_F32 or xt.dtype == tl.float32:       # (the interpreter, float32 activations)
        q, xt = q.to(tl.float32) - zq.to(tl.float32)[:, None], xt.to(tl.float32)
    elif not sub_asm:
        q = q - zq[:, None]                                             # exact: q - z
    return tl.dot(q, xt, input_precision=PRECISION)


@triton.jit
def unpack_int4_bf16_asm(words, zq, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``dot_step_int4``'s unpacking and zero-point subtraction in PTX (bfloat16 only;
    HEADRACE_W4A16_ASM=1, compiled kernels): a word's four magic pairs by one LOP3 each
    ((w >> 4i) & 0x000F000F | 0x43004300), put in K order by four byte permutes, less 128 + z by
    four bfloat16x2 subtractions: 15 instructions a word, where the compiler made ~23 of the same
    steps written in Triton (the and and the or not fused, extra permutes)."""
    zb = tl.broadcast_to(zq[:, None], words.shape)
    o = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, t0, t1, t2, t3, p0, p1, p2, p3, z2;
        mov.b32 z2, {$9, $9};
        lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $8, 4;
        lop3.b32 t1, s, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $8, 8;
        lop3.b32 t2, s, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 s, $8, 12;
        lop3.b32 t3, s, 0x000F000F, 0x43004300, 0xEA;
        prmt.b32 p0, t0, t1, 0x5410;
        prmt.b32 p1, t2, t3, 0x5410;
        prmt.b32 p2, t0, t1, 0x7632;
        prmt.b32 p3, t2, t3, 0x7632;
        sub.rn.bf16x2 p0, p0, z2;
        sub.rn.bf16x2 p1, p1, z2;
        sub.rn.bf16x2 p2, p2, z2;
        sub.rn.bf16x2 p3, p3, z2;
        mov.b32 {$0, $1}, p0;
        mov.b32 {$2, $3}, p1;
        mov.b32 {$4, $5}, p2;
        mov.b32 {$6, $7}, p3;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h", args=[words, zb],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    q = tl.join(tl.join(tl.join(o[0], o[1]), tl.join(o[2], o[3])),
                tl.join(tl.join(o[4], o[5]), tl.join(o[6], o[7])))     # [BN, KW, 2, 2, 2]
    q = tl.permute(q, (0, 1, 4, 3, 2))                                  # value = the last bits
    return tl.reshape(q, [BLOCK_N, BLOCK_K])
