"""Micro-benchmark of the quantized linear kernels on the GPU at decode/prefill row counts.

For Llama-3.1-8B's projection shapes (qkv, o, gate_up, down) and M = 1..256 rows, times
bf16 ``torch.nn.functional.linear`` (the baseline), W8A16 and W4A16 (group 128) through
``kernels.triton_quant.wna16_linear``, and FP8 W8A8 through ``kernels.triton_quant.fp8_linear``
(activation quantisation + ``torch._scaled_mm``), with ``triton.testing.do_bench`` (median).
Prints microseconds and the bandwidth of the bytes each must read (weights + scales +
activations): at decode the GEMMs are bound by weight bytes, INT4 reads a quarter of bf16.

    python -m bench.quant_kernels [--m 1,16,64,256] [--shapes qkv,o,gate_up,down] [--sweep]

``--sweep`` also times the W4A16 GEMM over a grid of tile shapes and K splits per shape and M
and prints the fastest beside the default (``triton_quant._tiles``), and splits FP8's time
into the activation quantisation and the ``_scaled_mm`` alone.
"""

from __future__ import annotations

import argparse

import torch
import triton

from kernels import reference_quant, triton_quant

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


def fp8_parts(name: str, n: int, k: int, m: int, wq, ws, dev) -> None:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xq, sx = triton_quant.per_token_fp8(x)
    quant = triton.testing.do_bench(lambda: triton_quant.per_token_fp8(x), warmup=10, rep=40)
    mm = triton.testing.do_bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=ws.view(1, n),
                                                          out_dtype=torch.bfloat16), warmup=10, rep=40)
    print(f"fp8 parts {name:>8} {m:>4} | act quant {quant * 1e3:6.1f} us | _scaled_mm {mm * 1e3:6.1f} us",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,8,16,32,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also sweep W4A16 tiles; split FP8's time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = [int(m) for m in args.m.split(",")]
    print(f"{'shape':>8} {'M':>4} | {'bf16 us':>8} {'GB/s':>6} | {'w8a16 us':>8} {'GB/s':>6} | "
          f"{'w4a16 us':>8} {'GB/s':>6} | {'fp8 us':>8} {'GB/s':>6}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w8 = _wna16_args(n, k, 8, k, dev)
        w4 = _wna16_args(n, k, 4, 128, dev)
        wq, ws = reference_quant.quantize_fp8_weight(w)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            act = m * k * 2 + m * n * 2
            cases = [
                (lambda: torch.nn.functional.linear(x, w), n * k * 2),
                (lambda: triton_quant.wna16_linear(x, *w8), n * k + n * 5),
                (lambda: triton_quant.wna16_linear(x, *w4), n * k // 2 + (k // 128) * n * 5),
                (lambda: triton_quant.fp8_linear(x, wq, ws), n * k + n * 4 + m * k),
            ]
            cols = []
            for fn, weight_bytes in cases:
                us = triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3
                cols.append(f"{us:8.1f} {(weight_bytes + act) / us / 1e3:6.0f}")
            print(f"{name:>8} {m:>4} | " + " | ".join(cols), flush=True)
            if args.sweep:
                sweep(name, n, k, m, w4, dev)
                fp8_parts(name, n, k, m, wq, ws, dev)


if __name__ == "__main__":
    main()
