"""Micro-benchmark of the quantized linear kernels on the GPU at decode/prefill row counts.

For Llama-3.1-8B's projection shapes (qkv, o, gate_up, down) and M = 1..256 rows, times
bf16 ``torch.nn.functional.linear`` (the baseline), W8A16 and W4A16 (group 128) through
``kernels.triton_quant.wna16_linear``, and FP8 weights through ``kernels.triton_quant.fp8_linear``
both ways: W8A8 (activation quantisation + ``torch._scaled_mm``) and the FP8-weight skinny GEMM
(``kernels.triton_fp8_linear``, W8A16), with ``triton.testing.do_bench`` (median). Prints
microseconds and the bandwidth of the bytes each must read (weights + scales + activations):
at decode the GEMMs are bound by weight bytes, INT4 reads a quarter of bf16. Then the FP8
crossover table: per shape and M, each FP8 kernel's µs and TB/s of weight bytes alone, the
faster, and the kernel ``fp8_linear`` picks now (``FP8_SKINNY_MAX_ROWS``); the skinny kernel is
checked against ``reference_quant.fp8_weight_linear`` first at every shape and M.

    python -m bench.quant_kernels [--m 1,8,16,32,64,128,256] [--shapes qkv,o,gate_up,down]
                                  [--fp8] [--sweep]

``--fp8`` times only bf16 and the two FP8 kernels (the crossover, quickly). ``--sweep`` also
times the W4A16 GEMM and the FP8 skinny GEMM over grids of tile shapes and K splits per shape
and M and prints the fastest beside the default (``triton_quant._tiles``,
``triton_fp8_linear._tiles``), and splits W8A8's time into the activation quantisation and the
``_scaled_mm`` alone.
"""

from __future__ import annotations

import argparse

import torch
import triton

import kernels
from kernels import reference_quant, triton_fp8_linear, triton_quant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _wna16_args(n: int, k: int, bits: int, group: int, dev):
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32, device=dev).to(torch.uint8)
    qweight = reference_quant.pack_along_k(q.cpu(), bits).to(dev)
    groups = k // group
    scales = torch.rand(groups, n, device=dev) * 0.01     # float32, as the loader keeps them
    zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.uint8, device=dev)
    g_idx = (torch.arange(k, device=dev) // group).to(torch.int32)
    return qweight, scales, zeros, g_idx, None, bits, group


SWEEP = [(bm, bn, bk, w, sk) for bm, bn, bk, w in ((16, 32, 128, 4), (16, 64, 128, 4), (16, 128, 128, 4),
                                                   (16, 64, 128, 8), (64, 64, 64, 4), (128, 128, 32, 8),
                                                   (64, 128, 64, 4))
         for sk in (1, 2, 4, 8, 16)]


def sweep(name: str, n: int, k: int, m: int, w4, dev) -> None:
    """The fastest W4A16 config at this shape and M beside the default; FP8's two parts."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    default = triton.testing.do_bench(lambda: triton_quant.wna16_linear(x, *w4), warmup=10, rep=40)
    best = (float("inf"), None)
    for cfg in SWEEP:
        if cfg[0] > max(16, 4 * m) or k // cfg[4] < cfg[2]:
            continue
        us = triton.testing.do_bench(lambda: triton_quant.wna16_linear(x, *w4, config=cfg), warmup=5, rep=20)
        best = min(best, (us, cfg))
    print(f"sweep {name:>8} {m:>4} | w4a16 default {default * 1e3:7.1f} us {triton_quant._tiles(m, n, k, 4)} "
          f"| best {best[0] * 1e3:7.1f} us {best[1]}", flush=True)


FP8_SWEEP = [(bm, bn, bk, w, sk) for bm, bn, bk, w in ((16, 32, 256, 4), (16, 64, 256, 4), (16, 32, 512, 4),
                                                       (16, 64, 128, 4), (32, 64, 128, 4), (64, 64, 128, 4),
                                                       (64, 128, 128, 8), (128, 128, 64, 8), (128, 64, 128, 8))
             for sk in (1, 2, 4, 8)]


def fp8_sweep(name: str, n: int, k: int, m: int, wq, ws, dev) -> None:
    """The fastest FP8 skinny config at this shape and M beside the default."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    run = triton_fp8_linear.fp8_weight_linear
    default = triton.testing.do_bench(lambda: run(x, wq, ws), warmup=10, rep=40)
    best = (float("inf"), None)
    for cfg in FP8_SWEEP:
        if cfg[0] > max(16, 4 * m) or k // cfg[4] < cfg[2]:
            continue
        us = triton.testing.do_bench(lambda: run(x, wq, ws, config=cfg), warmup=5, rep=20)
        best = min(best, (us, cfg))
    print(f"sweep {name:>8} {m:>4} | fp8 skinny default {default * 1e3:7.1f} us "
          f"{triton_fp8_linear._tiles(m, n, k)} | best {best[0] * 1e3:7.1f} us {best[1]}", flush=True)


def check_fp8_skinny(x, wq, ws) -> None:
    """The compiled skinny kernel equals the plain-torch reference (bf16 rounding of the output)."""
    got = triton_fp8_linear.fp8_weight_linear(x, wq, ws)
    want = reference_quant.fp8_weight_linear(x, wq, ws)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * scale, rtol=1e-2)


def fp8_parts(name: str, n: int, k: int, m: int, wq, ws, dev) -> None:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xq, sx = triton_quant.per_token_fp8(x)
    quant = triton.testing.do_bench(lambda: triton_quant.per_token_fp8(x), warmup=10, rep=40)
    mm = triton.testing.do_bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=ws.view(1, n),
                                                          out_dtype=torch.bfloat16), warmup=10, rep=40)
    print(f"fp8 parts {name:>8} {m:>4} | act quant {quant * 1e3:6.1f} us | _scaled_mm {mm * 1e3:6.1f} us",
          flush=True)


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3


def fp8_table(results: list[tuple], dev) -> None:
    """Per shape and M: bf16, _scaled_mm and skinny µs with TB/s of their weight bytes, the
    skinny kernel's speed-up over bf16, the faster FP8 kernel and the one ``kernels.fp8_linear``
    takes now (``kernels.fp8_linear_kernel``); then the largest M each shape's skinny wins."""
    print(f"\nFP8 crossover (FP8_SKINNY_MAX_ROWS = {triton_quant.FP8_SKINNY_MAX_ROWS}; TB/s of "
          f"weight bytes)\n{'shape':>8} {'M':>4} | {'bf16 us':>8} {'TB/s':>5} | {'w8a8 us':>8} "
          f"{'TB/s':>5} | {'skinny us':>9} {'TB/s':>5} {'x bf16':>6} | {'faster':>10} | {'picked':>10}")
    wins: dict[str, int] = {}
    for name, m, bf16, mm, skinny, n, k in results:
        faster = "fp8_skinny" if skinny < mm else "scaled_mm"
        if faster == "fp8_skinny":
            wins[name] = max(wins.get(name, 0), m)
        print(f"{name:>8} {m:>4} | {bf16:8.1f} {n * k * 2 / bf16 / 1e6:5.2f} | {mm:8.1f} "
              f"{(n * k + n * 4) / mm / 1e6:5.2f} | {skinny:9.1f} {(n * k + n * 4) / skinny / 1e6:5.2f} "
              f"{bf16 / skinny:6.2f} | {faster:>10} | {kernels.fp8_linear_kernel(m, dev):>10}", flush=True)
    print("largest M where the skinny kernel is faster: "
          + ", ".join(f"{name} {wins.get(name, 0)}" for name in dict.fromkeys(r[0] for r in results)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,8,16,32,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--fp8", action="store_true", help="only bf16 and the two FP8 kernels")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep W4A16 and FP8 skinny tiles; split W8A8's time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = [int(m) for m in args.m.split(",")]
    heads = ["bf16"] + ([] if args.fp8 else ["w8a16", "w4a16"]) + ["fp8 w8a8", "fp8 skin"]
    print(f"{'shape':>8} {'M':>4} | " + " | ".join(f"{h + ' us':>11} {'GB/s':>6}" for h in heads))
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w8 = None if args.fp8 else _wna16_args(n, k, 8, k, dev)
        w4 = None if args.fp8 else _wna16_args(n, k, 4, 128, dev)
        wq, ws = reference_quant.quantize_fp8_weight(w)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            check_fp8_skinny(x, wq, ws)
            act = m * k * 2 + m * n * 2
            cases = [(lambda: torch.nn.functional.linear(x, w), n * k * 2)]
            if not args.fp8:
                cases += [(lambda: triton_quant.wna16_linear(x, *w8), n * k + n * 5),
                          (lambda: triton_quant.wna16_linear(x, *w4), n * k // 2 + (k // 128) * n * 5)]
            cases += [
                (lambda: triton_quant.fp8_linear(x, wq, ws, kernel="scaled_mm"), n * k + n * 4 + m * k),
                (lambda: triton_quant.fp8_linear(x, wq, ws, kernel="fp8_skinny"), n * k + n * 4),
            ]
            times = [_us(fn) for fn, _ in cases]
            print(f"{name:>8} {m:>4} | " + " | ".join(
                f"{us:11.1f} {(b + act) / us / 1e3:6.0f}" for us, (_, b) in zip(times, cases)), flush=True)
            results.append((name, m, times[0], times[-2], times[-1], n, k))
            if args.sweep:
                if w4 is not None:
                    sweep(name, n, k, m, w4, dev)
                fp8_sweep(name, n, k, m, wq, ws, dev)
                fp8_parts(name, n, k, m, wq, ws, dev)
    fp8_table(results, dev)


if __name__ == "__main__":
    main()
