"""Every candidate quantized GEMM side by side at decode row counts, on the GPU: which kernel
wins per scheme, weight shape and M, and the table ``kernels.quant_dispatch`` reads.

For Llama-3.1-8B's projection shapes (qkv, o, gate_up, down) and M rows (default 1, 4, 16, 64,
128, 256, and 2048 for prefill chunks), times bf16 ``torch.nn.functional.linear`` (cuBLAS, the baseline) and each kernel of
``kernels.quant_dispatch.KERNELS`` that is installed and takes the layer: FP8 per-channel weights
(``fp8_skinny`` W8A16, ``scaled_mm`` W8A8 with the activation quantiser, ``gemlite_fp8``,
``fbgemm_rowwise``) and INT4 group-128 weights (``triton_skinny``, ``triton``, ``tinygemm``,
``gemlite``, ``fbgemm_i4``); ``--schemes ...,w8a16`` adds INT8 group-128 weights. Each kernel is first checked against ``kernels.reference_quant``
(a wrong one is reported and never ranked). Times are device time per call, replayed from one
CUDA graph over enough distinct copies of the weights (>= 256 MB) that the 50 MB L2 cannot
serve repeats, as a decode step runs: no launch overhead, no autotuning (our skinny kernels
tune at their first, eager call). Prints per scheme µs, TB/s of the bytes a call must read
(weights, scales, activations) and each kernel's time against bf16's, the winner, and the
issue-32 targets (FP8 <= 0.6x bf16; INT4 <= 0.35x at M = 1, <= 0.5x at M = 16).

    python -m bench.quant_kernels [--m 1,4,16,64,128,256,2048] [--shapes qkv,o,gate_up,down]
                                  [--schemes fp8,w4a16] [--table OUT.json] [--tiles]

``--table``: writes the rankings (fastest first, per scheme, shape and M) in
``kernels/quant_dispatch.json``'s format. ``--tiles``: also prints the tile our skinny
kernels' autotuner chose per shape and M.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import time

import torch

from bench.kernels import graph_ms
from kernels import quant_dispatch, quant_libs, reference_quant as ref
from kernels import skinny_gemm, triton_fp8_linear, triton_quant, triton_w4a16

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
ROTATE_BYTES = 256 << 20          # distinct weights per graph: past the H200's 50 MB L2
DTYPE = torch.bfloat16


def _fp8_weights(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return ref.quantize_fp8_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)


def _int_weights(n, k, seed, bits):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), device="cuda", generator=g, dtype=torch.int32)
    scales = torch.rand(k // GROUP, n, device="cuda", generator=g) * 0.002 + 1e-4
    zeros = torch.randint(0, 1 << bits, (k // GROUP, n), device="cuda", generator=g,
                          dtype=torch.int32)
    return ref.pack_along_k(q.to(torch.uint8), bits), scales, zeros.to(torch.uint8)


def _bits(scheme):
    return {"w4a16": 4, "w8a16": 8}.get(scheme, 8)


def _weight_bytes(scheme, n, k):
    if scheme == "bf16":
        return 2 * n * k
    return n * k + 4 * n if scheme == "fp8" else n * k * _bits(scheme) // 8 + 5 * n * (k // GROUP)


def _caller(scheme, kernel, w):
    """A function of x for one copy of the weights ``w``, through ``kernel``."""
    if scheme == "bf16":
        return lambda x: torch.nn.functional.linear(x, w)
    if kernel in quant_libs.KERNEL_LIBRARY:
        state = (quant_libs.prepare_fp8(kernel, *w, DTYPE) if scheme == "fp8"
                 else quant_libs.prepare_wna16(kernel, *w, _bits(scheme), GROUP, DTYPE))
        return lambda x: quant_libs.run(kernel, state, x, None)
    if scheme == "fp8":
        return lambda x: triton_quant.fp8_linear(x, *w, kernel=kernel)
    bits = _bits(scheme)
    if kernel == "triton_skinny":
        return lambda x: triton_w4a16.w4a16_linear(x, *w, None, bits, GROUP)
    g_idx = (torch.arange(w[0].shape[0] * 32 // bits, device="cuda") // GROUP).to(torch.int32)
    return lambda x: triton_quant.wna16_linear(x, *w, g_idx, None, bits, GROUP, kernel="triton")


def _reference(scheme, kernel, w, x):
    if scheme == "fp8":
        if kernel in ("scaled_mm", "fbgemm_rowwise"):   # W8A8: the activations rounded too
            return ref.fp8_linear(x, *w)
        return ref.fp8_weight_linear(x, *w)
    bits = _bits(scheme)
    g_idx = (torch.arange(w[0].shape[0] * 32 // bits, device="cuda") // GROUP).to(torch.int32)
    return ref.wna16_linear(x.float(), w[0], w[1], w[2], g_idx, None, bits, GROUP)


def candidates(scheme, n, k) -> list[str]:
    """The kernels of ``scheme`` that are installed and take an [n, k] layer (bf16 inputs)."""
    out = []
    for kernel in quant_dispatch.KERNELS[scheme]:
        if kernel in quant_libs.KERNEL_LIBRARY:
            if not quant_libs.takes(kernel, scheme="fp8" if scheme == "fp8" else "wna16", n=n,
                                    k=k, dtype=DTYPE, bits=_bits(scheme), group_size=GROUP):
                continue
        out.append(kernel)
    return out


def measure(scheme, kernel, n, k, ms, tiles=False) -> dict[int, float | str]:
    """µs per call at each M (or why the kernel failed) for ``kernel`` on an [n, k] layer;
    ``tiles``: print the tile our skinny kernels tuned at each M."""
    make = {"bf16": lambda s: torch.randn(n, k, device="cuda", dtype=DTYPE, generator=torch.Generator(
        device="cuda").manual_seed(s)) * 0.02, "fp8": lambda s: _fp8_weights(n, k, s),
        "w4a16": lambda s: _int_weights(n, k, s, 4), "w8a16": lambda s: _int_weights(n, k, s, 8)
    }[scheme]
    copies = max(1, math.ceil(ROTATE_BYTES / _weight_bytes(scheme, n, k)))
    try:
        weights = [make(seed) for seed in range(copies)]
        calls = [_caller(scheme, kernel, w) for w in weights]
    except Exception as exc:     # a library that cannot prepare this layer
        return {m: f"prepare failed: {type(exc).__name__}: {exc}"[:90] for m in ms}
    out = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        try:
            if scheme != "bf16":
                got, want = calls[0](x).float(), _reference(scheme, kernel, weights[0], x).float()
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                if not err <= 2e-2:
                    out[m] = f"wrong (max error {err:.3g} of the output's scale)"
                    continue
                if tiles and kernel in ("fp8_skinny", "triton_skinny"):
                    tuner = (triton_fp8_linear if scheme == "fp8" else triton_w4a16).TUNER
                    print(f"  {kernel} {n}x{k} M={m}: tile {tuner.chosen()}", flush=True)
            out[m] = graph_ms([lambda c=c: c(x) for c in calls], replays=5) * 1e3
        except Exception as exc:
            out[m] = f"failed: {type(exc).__name__}: {exc}"[:90]
    del weights, calls
    torch.cuda.empty_cache()
    return out


def report(scheme, results, ms, shapes) -> dict:
    """Prints one scheme's table; returns its rankings {"NxK": {"M": [kernel, ...]}}."""
    kernels = list(dict.fromkeys(k for s in shapes for k in results[s] if k != "bf16"))
    print(f"\n{scheme}: µs per call (TB/s of the bytes read; x bf16), graph-replayed over "
          f">= {ROTATE_BYTES >> 20} MB of weights\n{'shape':>8} {'M':>4} | {'bf16':>15} | "
          + " | ".join(f"{k:>22}" for k in kernels) + " | best")
    rankings = {}
    for name in shapes:
        n, k = SHAPES[name]
        by_m = rankings.setdefault(f"{n}x{k}", {})
        for m in ms:
            base = results[name]["bf16"][m]
            act = 2 * m * (n + k)
            cells, timed = [], {}
            for kern in kernels:
                us = results[name].get(kern, {}).get(m, "does not take the layer")
                if isinstance(us, str):
                    cells.append(f"{us[:22]:>22}")
                    continue
                timed[kern] = us
                tbs = (_weight_bytes(scheme, n, k) + act) / us / 1e6
                cells.append(f"{us:7.1f} ({tbs:4.2f}; {us / base:4.2f}x)")
            ranked = sorted(timed, key=timed.get)
            by_m[str(m)] = ranked
            best = f"{ranked[0]} {timed[ranked[0]] / base:.2f}x" if ranked else "-"
            btb = (_weight_bytes("bf16", n, k) + act) / base / 1e6
            print(f"{name:>8} {m:>4} | {base:7.1f} ({btb:4.2f}) | " + " | ".join(cells) + f" | {best}")
    targets = ({1: 0.35, 16: 0.5} if scheme == "w4a16" else {m: 0.6 for m in ms if m <= 64}
               if scheme == "fp8" else {})
    for m, limit in targets.items():
        if m not in ms:
            continue
        worst = max(min([us for us in (results[s].get(kern, {}).get(m) for kern in kernels)
                         if isinstance(us, float)] or [math.inf]) / results[s]["bf16"][m]
                    for s in shapes)
        print(f"target {scheme} M={m}: best kernel <= {limit}x bf16 on every shape: "
              f"{'met' if worst <= limit else 'NOT met'} (worst shape {worst:.2f}x)")
    return rankings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,4,16,64,128,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--schemes", default="fp8,w4a16")
    ap.add_argument("--table", help="write the rankings here (kernels/quant_dispatch.json format)")
    ap.add_argument("--tiles", action="store_true", help="print our skinny kernels' tuned tiles")
    args = ap.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    shapes = args.shapes.split(",")
    for library in ("torch", "gemlite", "fbgemm"):
        print(f"{library}: {quant_libs.why_not(library) or 'available'}")
    start, rankings = time.time(), {}
    for scheme in args.schemes.split(","):
        results = {}
        for name in shapes:
            n, k = SHAPES[name]
            results[name] = {"bf16": measure("bf16", None, n, k, ms)}
            for kernel in candidates(scheme, n, k):
                results[name][kernel] = measure(scheme, kernel, n, k, ms, args.tiles)
            print(f"[{time.time() - start:5.0f} s] {scheme} {name} measured", flush=True)
        rankings[scheme] = report(scheme, results, ms, shapes)
    if args.table:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.table, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "commit": commit, "date": datetime.date.today().isoformat(),
                       "rows": ms, "rankings": rankings}, f, indent=1)
        print(f"rankings written to {args.table} (commit as kernels/quant_dispatch.json)")
    print(f"skinny buckets {skinny_gemm.M_BUCKETS}; done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
