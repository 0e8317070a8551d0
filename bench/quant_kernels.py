"""Every candidate quantized GEMM side by side at decode row counts, on the GPU: which kernel
wins per scheme, weight shape and M, the skinny kernels' best tile per bucket, and the table
``headrace.kernels.quant_dispatch`` reads (rankings and pinned tiles).

For Llama-3.1-8B's projection shapes (qkv, o, gate_up, down) and M rows (default 1, 16, 64), times
bf16 ``torch.nn.functional.linear`` (cuBLAS, the baseline, once per shape) and each kernel of
``headrace.kernels.quant_dispatch.KERNELS`` that is installed, asked for (``--libs``) and takes the
layer: FP8 per-channel weights (``fp8_skinny`` W8A16; ``fp8_w8a8`` and ``scaled_mm``, W8A8 with the
activation quantiser; ``fp8_w8a8_inline``, W8A8 quantising its rows itself; ``gemlite_fp8``,
``fbgemm_rowwise``) and INT4 group-128 weights (``triton_skinny``, ``triton_tiled`` on its repacked
layout, ``triton``, ``tinygemm``, ``gemlite``, ``fbgemm_i4``); ``--schemes ...,w8a16`` adds INT8
group-128 weights. Times are device time per call, replayed from one CUDA graph over enough distinct
copies of the weights (>= 256 MB, built once per shape and scheme and shared by every kernel) that
the 50 MB L2 cannot serve repeats, as a decode step runs.

Our skinny kernels time ``--sweep`` tiles per row bucket here (the fixed tile of
``headrace.kernels.skinny_gemm`` first, then the bucket's list), outside ``triton.autotune``; the
fastest is their time and is written to the table's ``tiles``, so the server runs it without
timing anything. Each kernel is checked once against ``headrace.kernels.reference_quant`` on a small
input (a wrong one is reported and never ranked), and each swept tile on its M's input before
it is timed (a wrong tile is reported and never pinned). A library whose first kernel (its layouts,
its compile, the check, the timings of one shape) fails is skipped from then on, and so is one
whose first kernel takes longer than ``--lib-first-call`` seconds, or any once ``--budget``
seconds have passed (ours are always measured). gemlite is not
in the default ``--libs``: its kernels take N and K as compile-time constants (a compile per
shape and kernel, ~10 a scheme here). Prints per scheme µs, TB/s of the bytes a call must read
(weights, scales, activations) and each kernel's time against bf16's, the winner, and the
issue-32 targets (FP8 <= 0.6x bf16; INT4 <= 0.35x at M = 1, <= 0.5x at M = 16).

    python -m bench.quant_kernels [--m 1,16,64] [--shapes qkv,o,gate_up,down]
        [--schemes fp8,w4a16] [--libs torch,fbgemm] [--sweep 4] [--table OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import time

import torch

from bench.kernels import graph_ms
from headrace.kernels import quant_dispatch, quant_libs, reference_quant as ref
from headrace.kernels import (skinny_gemm, triton_fp8_linear, triton_fp8_w8a8,
                              triton_fp8_w8a8_inline, triton_quant, triton_w4a16,
                              triton_w4a16_tiled)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
ROTATE_BYTES = 256 << 20          # distinct weights per graph: past the H200's 50 MB L2
DTYPE = torch.bfloat16
DEVICE = "cuda"                   # "cpu": the tests' interpreted smoke run
SKINNY = {"fp8_skinny": triton_fp8_linear, "fp8_w8a8": triton_fp8_w8a8,
          "fp8_w8a8_inline": triton_fp8_w8a8_inline, "triton_tiled": triton_w4a16_tiled,
          "triton_skinny": triton_w4a16}
W8A8 = ("fp8_w8a8", "scaled_mm", "fbgemm_rowwise")   # the activations rounded to e4m3 too
OWN_TILES = ("fp8_w8a8", "fp8_w8a8_inline", "triton_tiled")   # kernels whose tiles the table pins under their name
# the layers whose rows the norm and SiLU kernels quantise when a W8A8 kernel runs them
# (headrace.dataplane.model: wants_fp8_rows); o's come from attention and pay the quantiser
ROWS_LAYERS = ("qkv", "gate_up", "down")


def _weights(scheme, n, k, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if scheme == "bf16":
        return torch.randn(n, k, device=DEVICE, dtype=DTYPE, generator=g) * 0.02
    if scheme == "fp8":
        return ref.quantize_fp8_weight(torch.randn(n, k, device=DEVICE, generator=g) * 0.02)
    bits = _bits(scheme)
    q = torch.randint(0, 1 << bits, (n, k), device=DEVICE, generator=g, dtype=torch.int32)
    scales = torch.rand(k // GROUP, n, device=DEVICE, generator=g) * 0.002 + 1e-4
    zeros = torch.randint(0, 1 << bits, (k // GROUP, n), device=DEVICE, generator=g,
                          dtype=torch.int32)
    return ref.pack_along_k(q.to(torch.uint8), bits), scales, zeros.to(torch.uint8)


def copies(scheme, n, k) -> list:
    """Distinct weights of one layer, >= ROTATE_BYTES together."""
    return [_weights(scheme, n, k, seed)
            for seed in range(max(1, math.ceil(ROTATE_BYTES / _weight_bytes(scheme, n, k))))]


def _bits(scheme):
    return {"w4a16": 4, "w8a16": 8}.get(scheme, 8)


def _weight_bytes(scheme, n, k):
    if scheme == "bf16":
        return 2 * n * k
    return n * k + 4 * n if scheme == "fp8" else n * k * _bits(scheme) // 8 + 5 * n * (k // GROUP)


_TILED: dict = {}     # id(qweight) -> (qweight, its tiled layout): the sweep's calls share it


def _caller(scheme, kernel, w, tile=None):
    """A function of x for one copy of the weights ``w``, through ``kernel`` (a skinny one at
    ``tile``, or its pinned / fixed tile)."""
    if scheme == "bf16":
        return lambda x: torch.nn.functional.linear(x, w)
    if kernel in quant_libs.KERNEL_LIBRARY:
        state = (quant_libs.prepare_fp8(kernel, *w, DTYPE) if scheme == "fp8"
                 else quant_libs.prepare_wna16(kernel, *w, _bits(scheme), GROUP, DTYPE))
        return lambda x: quant_libs.run(kernel, state, x, None)
    if kernel == "fp8_skinny":
        return lambda x: triton_fp8_linear.fp8_weight_linear(x, *w, tile=tile)
    if kernel == "fp8_w8a8":     # timed with its activation quantiser, as the libraries' W8A8
        return lambda x: triton_fp8_w8a8.w8a8_linear(*triton_quant.per_token_fp8(x), *w,
                                                     out_dtype=x.dtype, tile=tile)
    if kernel == "fp8_w8a8_inline":
        return lambda x: triton_fp8_w8a8_inline.w8a8_inline_linear(x, *w, tile=tile)
    if scheme == "fp8":
        return lambda x: triton_quant.fp8_linear(x, *w, kernel=kernel)
    bits = _bits(scheme)
    if kernel == "triton_tiled":      # its layout made once per weight copy
        tiled = _TILED.get(id(w[0]))
        if tiled is None:
            tiled = _TILED[id(w[0])] = (w[0], triton_w4a16_tiled.pack_tiled(w[0]))
        return lambda x: triton_w4a16_tiled.w4a16_tiled_linear(x, tiled[1], w[1], w[2], GROUP,
                                                               tile=tile)
    if kernel == "triton_skinny":
        return lambda x: triton_w4a16.w4a16_linear(x, *w, None, bits, GROUP, tile=tile)
    g_idx = (torch.arange(w[0].shape[0] * 32 // bits, device=DEVICE) // GROUP).to(torch.int32)
    return lambda x: triton_quant.wna16_linear(x, *w, g_idx, None, bits, GROUP, kernel="triton")


def _reference(scheme, kernel, w, x):
    if scheme == "fp8":
        if kernel in W8A8:
            return ref.fp8_linear(x, *w)
        if kernel == "fp8_w8a8_inline":
            return ref.fp8_group_linear(x, *w)
        return ref.fp8_weight_linear(x, *w)
    bits = _bits(scheme)
    g_idx = (torch.arange(w[0].shape[0] * 32 // bits, device=DEVICE) // GROUP).to(torch.int32)
    return ref.wna16_linear(x.float(), w[0], w[1], w[2], g_idx, None, bits, GROUP)


def candidates(scheme, n, k, libs) -> list[str]:
    """Our kernels of ``scheme`` and those of the libraries in ``libs`` that are installed and
    take an [n, k] layer (bf16 inputs)."""
    out = []
    for kernel in quant_dispatch.KERNELS[scheme]:
        library = quant_libs.KERNEL_LIBRARY.get(kernel)
        if library is not None and (library not in libs or not quant_libs.takes(
                kernel, scheme="fp8" if scheme == "fp8" else "wna16", n=n, k=k, dtype=DTYPE,
                bits=_bits(scheme), group_size=GROUP)):
            continue
        if kernel == "triton_tiled" and not triton_w4a16_tiled.supports(_bits(scheme), GROUP, n, k):
            continue
        out.append(kernel)
    return out


def sweep_tiles(scheme, kernel, n, k, m, count) -> list:
    """The skinny kernel's fixed tile for M rows, then up to ``count`` - 1 more of its bucket's
    list (a tile of another K step than the kernel's does not fit it)."""
    module, bucket = SKINNY[kernel], skinny_gemm.m_bucket(m)
    args = {"K": k, "stride_wn": k, "X": torch.empty(0, dtype=DTYPE),   # a layer's, as `fits`
            "W": torch.empty(0, dtype=torch.uint8)}                     # reads them
    listed = [t for t in module.TILES[bucket] if module.TUNER.fits(t, args)]
    first = next(t for t in listed if t.split == 1)
    fixed = module.TUNER.split(first, bucket, n, k, skinny_gemm.sm_count(torch.device(DEVICE)),
                               _bits(scheme))
    return list(dict.fromkeys([fixed] + listed))[:max(1, count)]


def measure(scheme, kernel, weights, n, k, ms, sweep, tiles_out) -> dict:
    """µs per call at each M (or why not) for ``kernel`` over ``weights`` (its copies); the
    skinny kernels' best of their swept tiles (recorded in ``tiles_out[m]``). Raises when the
    kernel cannot prepare or run the layer, or is wrong on the check input."""
    calls = [_caller(scheme, kernel, w) for w in weights]
    x = torch.randn(ms[0], k, device=DEVICE, dtype=DTYPE)
    if scheme != "bf16":
        err = _error(calls[0](x), _reference(scheme, kernel, weights[0], x))
        if not err <= 2e-2:
            raise ValueError(f"wrong (max error {err:.3g} of the output's scale)")
    out = {}
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
        if kernel not in SKINNY:
            out[m] = graph_ms([lambda c=c: c(x) for c in calls], replays=5) * 1e3
            continue
        timed, want = {}, _reference(scheme, kernel, weights[0], x)
        for tile in sweep_tiles(scheme, kernel, n, k, m, sweep):
            tiled = [_caller(scheme, kernel, w, tile) for w in weights]
            err = _error(tiled[0](x), want)     # a wrong tile is never timed, so never pinned
            if not err <= 2e-2:
                print(f"  {kernel} {n}x{k} M={m}: tile {tile.as_list()} WRONG (max error "
                      f"{err:.3g} of the output's scale)", flush=True)
                continue
            timed[tile] = graph_ms([lambda c=c: c(x) for c in tiled], replays=5) * 1e3
        if not timed:
            raise ValueError(f"every swept tile is wrong at M = {m}")
        best = min(timed, key=timed.get)
        out[m], tiles_out[m] = timed[best], best
        print(f"  {kernel} {n}x{k} M={m}: " + ", ".join(
            f"{t.block_m}x{t.block_n}x{t.block_k}/{t.warps}w{t.stages}s/split{t.split}"
            f"{'' if t.dot else ' fma'} {us:.1f}" for t, us in timed.items()), flush=True)
    return out


def on_rows(kernel, weights, ms, tiles) -> dict:
    """µs per call of a W8A8 kernel on rows already quantised per token (as the norm and SiLU
    kernels hand them to qkv, gate_up and down: ``kernels.Fp8Rows``), no quantiser launch;
    fp8_w8a8 at the tile its sweep chose per M."""
    out = {}
    for m in ms:
        rows = triton_quant.per_token_fp8(torch.randn(m, weights[0][0].shape[1], device=DEVICE,
                                                      dtype=DTYPE))
        fp8_rows = ref.Fp8Rows(*rows, DTYPE)
        if kernel == "fp8_w8a8":
            calls = [lambda w=w: triton_fp8_w8a8.w8a8_linear(*rows, *w, tile=tiles.get(m))
                     for w in weights]
        elif kernel == "fbgemm_rowwise":
            states = [quant_libs.prepare_fp8(kernel, *w, DTYPE) for w in weights]
            calls = [lambda s=s: quant_libs.run_fp8_rows(kernel, s, fp8_rows, None)
                     for s in states]
        else:
            calls = [lambda w=w: triton_quant.fp8_linear(fp8_rows, *w) for w in weights]
        out[m] = graph_ms(calls, replays=5) * 1e3
    return out


def _error(got, want) -> float:
    """Max |got - want| over want's largest magnitude."""
    got, want = got.float(), want.float()
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)


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
    ap.add_argument("--m", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--schemes", default="fp8,w4a16")
    ap.add_argument("--libs", default="torch,fbgemm", help="libraries to measure (and gemlite)")
    ap.add_argument("--sweep", type=int, default=4, help="tiles timed per bucket (skinny kernels)")
    ap.add_argument("--lib-first-call", type=float, default=20.0)
    ap.add_argument("--budget", type=float, default=130.0, help="seconds; then ours only")
    ap.add_argument("--rows", action="store_true",
                    help="also time the W8A8 kernels on rows already quantised (no quantiser)")
    ap.add_argument("--rank-on-rows", action="store_true",
                    help="with --rows: rank (and table) the W8A8 kernels of qkv, gate_up and "
                         "down by their time on quantised rows, as those layers get them")
    ap.add_argument("--table", help="write rankings and tiles here (quant_dispatch.json format)")
    args = ap.parse_args()
    ms, shapes, schemes = ([int(m) for m in args.m.split(",")], args.shapes.split(","),
                           args.schemes.split(","))
    libs = set(args.libs.split(",")) - {""}
    for library in ("torch", "gemlite", "fbgemm"):
        print(f"{library}: {quant_libs.why_not(library) or 'available'}"
              f"{'' if library in libs else ' (not measured: --libs)'}")
    start, skipped, rows_results = time.time(), {}, {}
    results = {name: {} for name in shapes}
    tiles = {scheme: {} for scheme in schemes}
    for name in shapes:
        n, k = SHAPES[name]
        for scheme in ["bf16"] + schemes:
            weights = copies(scheme, n, k)
            for kernel in [None] if scheme == "bf16" else candidates(scheme, n, k, libs):
                library = quant_libs.KERNEL_LIBRARY.get(kernel)
                if library and time.time() - start > args.budget:
                    skipped.setdefault(library, f"skipped: past the {args.budget:.0f} s budget")
                if library in skipped:
                    results[name].setdefault(scheme, {})[kernel] = {m: skipped[library] for m in ms}
                    continue
                began, by_m = time.time(), {}
                try:
                    got = measure(scheme, kernel, weights, n, k, ms, args.sweep, by_m)
                except Exception as exc:   # cannot prepare or run the layer, or wrong
                    got = {m: f"failed: {type(exc).__name__}: {exc}"[:90] for m in ms}
                    if library:
                        skipped[library] = f"skipped: {library} failed"
                if library and time.time() - began > args.lib_first_call and library not in skipped:
                    skipped[library] = f"skipped: {library} too slow"
                results[name].setdefault(scheme, {})["bf16" if kernel is None else kernel] = got
                if args.rows and kernel in W8A8 and library not in skipped:
                    try:
                        rows_results.setdefault(name, {})[kernel] = on_rows(kernel, weights, ms,
                                                                            by_m)
                    except Exception as exc:
                        print(f"  {kernel} on quantised rows failed: {exc}"[:120], flush=True)
                for m, tile in by_m.items():   # fp8_w8a8's tiles under their own key
                    key = kernel if kernel in OWN_TILES else scheme
                    tiles.setdefault(key, {}).setdefault(f"{n}x{k}", {})[
                        str(skinny_gemm.m_bucket(m))] = tile.as_list()
            del weights
            torch.cuda.empty_cache()
        print(f"[{time.time() - start:5.0f} s] {name} measured", flush=True)
    if args.rank_on_rows:      # as served: those layers' W8A8 kernels get quantised rows
        for name in set(rows_results) & set(ROWS_LAYERS):
            results[name]["fp8"].update(rows_results[name])
        print(f"\nfp8: the W8A8 kernels of {', '.join(ROWS_LAYERS)} timed on quantised rows "
              "(--rank-on-rows)")
    rankings = {}
    for scheme in schemes:
        merged = {name: {"bf16": results[name]["bf16"]["bf16"], **results[name][scheme]}
                  for name in shapes}
        rankings[scheme] = report(scheme, merged, ms, shapes)
    if rows_results:
        print("\nfp8 W8A8 kernels on quantised rows (as qkv, gate_up and down get them; µs, "
              "x bf16):")
        for name, by_kernel in rows_results.items():
            base = results[name]["bf16"]["bf16"]
            print(f"{name:>8} " + " | ".join(
                f"{kern} " + " ".join(f"M={m} {us:.1f} ({us / base[m]:.2f}x)"
                                      for m, us in t.items())
                for kern, t in by_kernel.items()))
    if args.table:
        # HEADRACE_COMMIT: the tree's commit where its git metadata is stale (the device
        # machine's copy of a working tree kept the session's first HEAD in session 25)
        commit = os.environ.get("HEADRACE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.table, "w") as f:
            json.dump(table(rankings, tiles, ms, commit), f, indent=1)
        print(f"rankings and tiles written to {args.table} (commit as kernels/quant_dispatch.json)")
    print(f"done in {time.time() - start:.0f} s")


def table(rankings, tiles, ms, commit) -> dict:
    """quant_dispatch.json's content."""
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commit": commit, "date": datetime.date.today().isoformat(),
            "rows": ms, "rankings": rankings, "tiles": {s: t for s, t in tiles.items() if t}}


if __name__ == "__main__":
    main()
