"""The decode-shape ("skinny") quantized GEMMs compiled for SM90 on any machine (no GPU:
Triton's own ptxas and nvdisasm), with the machine code of their K loop counted per tile.

What it answers without device time: how many warp instructions a program spends on one
BLOCK_K step of its weight tile, and on what (conversions, the unpacking shifts, barriers,
shared-memory staging of the MMA operand, cross-thread reductions). A skinny GEMM moves a
weight tile of ``BLOCK_N x BLOCK_K x bits / 8`` bytes a step, so instructions a byte bound
it when they, not memory, are what an SM waits for: an H200 SM issues 4 warp instructions a
cycle, so at 1.98 GHz and 132 SMs a kernel spending I warp instructions a byte reads at most
4 * 1.98e9 * 132 / I bytes a second, all programs of an SM together.

    python -m bench.gemm_sass [--schemes w4a16,w4a16t,fp8,w8a8,w8a8i] [--tiles 16/64/4/3,64/128/4/3]

Tiles are BLOCK_M/BLOCK_N/warps/stages of the tl.dot program (BLOCK_M 1: the one-row
pipelined FMA program; BLOCK_K is the kernel's; ``w8a8`` is the W8A8 program on quantised
rows, ``w8a8i`` the one quantising its bf16 rows itself, ``w4a16t`` the INT4 program on the tiled
layout); the strides and sizes are compiled as
multiples of 16, as a launch specialises them. The readings (sessions 21 and 22) are in
docs/quantization.md (*What is left*)."""

from __future__ import annotations

import argparse

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.decode_ptx import sass_loops
from headrace.kernels import triton_fp8_linear, triton_fp8_w8a8, triton_w4a16, triton_w4a16_tiled

ISSUE_PER_S = 4 * 1.98e9 * 132   # an H200's warp instructions a second, every SM together
SHOWN = ("I2F", "F2FP", "SHF", "SGXT", "PRMT", "LOP3", "FFMA", "FADD", "SHFL", "BAR", "LDS",
         "STS", "LDG", "LDGSTS", "HGMMA", "QGMMA", "HMMA",
         "QMMA", "MUFU", "WARPSYNC")
_ALIGNED = ("X", "W", "QW", "S", "Z", "OUT", "WS", "CNT", "N", "K", "stride_xm", "stride_wn",
            "stride_om")


def compile_skinny(scheme: str, block_m: int, block_n: int, warps: int, stages: int,
                   asm: bool = False):
    """The scheme's skinny kernel for SM90, bf16 activations: the tl.dot program, or with
    block_m = 1 the one-row pipelined FMA program."""
    if scheme == "w4a16":
        kernel, block_k = triton_w4a16._w4a16_skinny_kernel, triton_w4a16.BLOCK_K
        types = {"X": "*bf16", "QW": "*i32", "S": "*bf16", "Z": "*u8"}
        const = {"BITS": 4, "ASM": asm, "EVEN_K": True, "EVEN_N": True,
                 "PACKED": asm and block_m == 1}
    elif scheme == "fp8":
        kernel, block_k = triton_fp8_linear._fp8_skinny_kernel, 256
        types = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32"}
        const = {"EVEN_K": True, "EVEN_N": True}
    elif scheme == "w4a16t":      # the tiled INT4 layout (headrace.kernels.triton_w4a16_tiled)
        kernel, block_k = triton_w4a16_tiled._tiled_kernel, 128
        types = {"X": "*bf16", "QW": "*i32", "S": "*bf16", "Z": "*u8"}
        const = {"EVEN_N": True}
    elif scheme in ("w8a8", "w8a8i"):     # W8A8 on quantised rows; w8a8i quantises bf16 rows
        kernel, block_k = triton_fp8_w8a8._w8a8_skinny_kernel, 128
        inline = scheme == "w8a8i"
        types = {"X": "*bf16" if inline else "*fp8e4nv", "SX": "*fp32", "W": "*fp8e4nv",
                 "S": "*fp32"}
        const = {"EVEN_K": True, "EVEN_N": True, "QUANT_X": inline}
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    types |= {"B": "*bf16", "OUT": "*bf16", "WS": "*fp32", "CNT": "*i32"}
    const |= dict(HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  USE_DOT=block_m > 1, PRECISION="tf32", DOT_F32=False, PIPE=block_m == 1)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]]
                           for n in _ALIGNED if n in names})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    bits = 4 if scheme.startswith("w4a16") else 8
    return compiled, block_n * block_k * bits // 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="w4a16,fp8")
    ap.add_argument("--asm", action="store_true", help="W4A16: the PTX unpacking (UNPACK_ASM; "
                    "the one-row program: on packed bfloat16 pairs, PACKED)")
    ap.add_argument("--tiles", default="16/64/4/4,16/64/4/3,64/128/4/3",
                    help="BLOCK_M/BLOCK_N/warps/stages, comma-separated (BLOCK_M 1: FMA program)")
    args = ap.parse_args()
    for scheme in args.schemes.split(","):
        for tile in args.tiles.split(","):
            block_m, block_n, warps, stages = map(int, tile.split("/"))
            compiled, step_bytes = compile_skinny(scheme, block_m, block_n, warps, stages,
                                                 args.asm)
            for n, ops in enumerate(sass_loops(compiled.asm["cubin"])):
                per_step = ops["total"] * warps      # every warp of the program runs the step
                bound = ISSUE_PER_S * step_bytes / per_step / 1e12
                counted = ", ".join(f"{k} {ops[k]}" for k in SHOWN if ops[k])
                print(f"{scheme:>5} {tile:>12} loop {n}: {ops['total']} instructions a warp a "
                      f"step ({step_bytes} weight bytes: {per_step / step_bytes:.2f} a byte, "
                      f"issue-bound at {bound:.1f} TB/s); {counted}", flush=True)


if __name__ == "__main__":
    main()
