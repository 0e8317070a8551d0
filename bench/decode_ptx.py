"""The decode attention kernel compiled for SM90 on any machine (no GPU: Triton's own ptxas),
with the memory and matrix instructions of its PTX counted, per cache dtype and tile. What it
answers without device time: are the K/V loads 16 bytes wide and pipelined (cp.async), does
a tile reach the tensor cores through ldmatrix, or is it read from shared memory a byte at a
time (an FP8 V tile is: 128 ld.shared.b8 a thread per 128-key tile, docs/quantization.md).

    python -m bench.decode_ptx [--kv fp8,bf16] [--tiles 128/4/3,64/4/3] [--group 2] [--ptx DIR]
    [--sass]

The strides are compiled as divisible by 16 (as a launch specialises the real ones); prints
one line per (dtype, tile): shared memory bytes and instruction counts. ``--sass`` adds the
machine code's loops (Triton's bundled ``nvdisasm`` on the cubin): per loop, instructions a
warp runs a step, per key for all the program's warps together, and the barriers, FP8
conversions and MMAs among them (session 20 chose the FP8 tile from this: two warps split a
tile's keys and cross them through shared memory, 9 barriers a step, one warp 2)."""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from headrace.kernels import triton_decode

COUNTED = r"(cp\.async\.c[ag]\.shared\.global|ld\.global(?:\.v\d)?\.b\d+|ld\.shared(?:\.v\d)?\.b\d+|" \
          r"st\.shared(?:\.v\d)?\.b\d+|ldmatrix[.a-z0-9]*|cvt\.rn\.f16x2\.e4m3x2|prmt\.b32|mma\.sync[.a-z0-9]*)"
# pointers and the strides a real launch specialises as multiples of 16 (not stride_bt)
ALIGNED = ("Q", "K", "V", "SEQ_LENS", "BT", "ORDER", "PART_O", "PART_LSE", "OUT", "stride_qt",
           "stride_qh", "stride_ot", "stride_oh", "stride_block", "stride_slot", "stride_head")


def compile_decode(kv: str, block_n: int, warps: int, stages: int, group: int, head_dim: int = 128,
                   v_t: bool = True):
    """The decode kernel for a bf16 query over a ``kv`` ("fp8" or "bf16") cache, one split;
    ``v_t``: an FP8 cache's V transposed within each block (the engine's layout)."""
    fp8 = kv == "fp8"
    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"Q": "*bf16", "K": cache, "V": cache, "SEQ_LENS": "*i32", "BT": "*i32", "ORDER": "*i32",
             "PART_O": "*fp32", "PART_LSE": "*fp32", "OUT": "*bf16", "qk_scale": "fp32", "v_scale": "fp32"}
    const = dict(NUM_SPLITS=1, G=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                 BLOCK_N=block_n, BLOCK_SIZE=16, PRECISION="tf32", DOT_F32=False, HAS_ORDER=True,
                 KV_F16=fp8, V_T=fp8 and v_t)
    names = triton_decode._decode_kernel.arg_names
    signature = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    src = ASTSource(fn=triton_decode._decode_kernel, signature=signature,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


SASS_OP = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def nvdisasm() -> pathlib.Path:
    """Triton's bundled disassembler."""
    import triton.backends.nvidia as nvidia
    return pathlib.Path(nvidia.__file__).parent / "bin" / "nvdisasm"


def sass_loops(cubin: bytes) -> list[collections.Counter]:
    """Per loop of the machine code (a label that a later branch jumps back to), the count of
    each opcode in its body; ``"total"`` holds the number of instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([str(nvdisasm()), "-c", f.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines)
              if line.strip().startswith(".L_x") and line.strip().endswith(":")}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i - 1:   # (not the end's self-branch)
            ops = collections.Counter(SASS_OP.findall("\n".join(lines[labels[target.group(1)]:i + 1])))
            ops["total"] = sum(ops.values())
            loops.append(ops)
    return loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", default="fp8,bf16")
    ap.add_argument("--tiles", default="128/4/3,64/4/3", help="BLOCK_N/warps/stages, comma-separated")
    ap.add_argument("--group", type=int, default=2, help="query heads per KV head (Qwen3-0.6B: 2)")
    ap.add_argument("--plain-v", action="store_true",
                    help="an FP8 V in the bf16 layout (before the transposed blocks)")
    ap.add_argument("--ptx", default=None, help="a directory to write each variant's PTX into")
    ap.add_argument("--sass", action="store_true", help="count the machine code's loops too")
    args = ap.parse_args()
    for kv in args.kv.split(","):
        for tile in args.tiles.split(","):
            block_n, warps, stages = map(int, tile.split("/"))
            kernel = compile_decode(kv, block_n, warps, stages, args.group,
                                    v_t=not args.plain_v)
            counts = collections.Counter(re.findall(COUNTED, kernel.asm["ptx"]))
            if args.ptx:
                pathlib.Path(args.ptx).mkdir(parents=True, exist_ok=True)
                pathlib.Path(args.ptx, f"decode-{kv}-{tile.replace('/', '-')}.ptx").write_text(kernel.asm["ptx"])
            print(f"{kv:>4} {tile:>10}: shared {kernel.metadata.shared:>6} B | "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
            for n, ops in enumerate(sass_loops(kernel.asm["cubin"]) if args.sass else ()):
                print(f"{'':>16}SASS loop {n}: {ops['total']} instructions a warp a step, "
                      f"{ops['total'] * warps / block_n:.1f} a key for the program; BAR {ops['BAR']}, "
                      f"F2FP {ops['F2FP']}, HMMA {ops['HMMA']}, LDGSTS {ops['LDGSTS']}, "
                      f"LDS {ops['LDS']}, LDSM {ops['LDSM']}, SHFL {ops['SHFL']}", flush=True)


if __name__ == "__main__":
    main()
