"""What ``--deterministic``'s batch-invariant kernels cost, kernel by kernel (issue 54): the
GEMM (``headrace.kernels.triton_invariant_gemm``) against the default path (the skinny kernel at 1-16
rows, cuBLAS above) at Qwen3-0.6B's and Llama-3.1-8B's projection and LM-head shapes and
1-2048 rows, and the attention (``headrace.kernels.triton_invariant_attention``) against the default
Triton kernels on decode batches and prefill chunks; each timed from a CUDA graph of a few
calls (launch cost as served), after a check that its rows are batch-invariant.

    python -m bench.det_kernels                  # both tables (~1 min on an H100)
    python -m bench.det_kernels --sweep          # + GEMM tiles per shape: the best, as PINNED

``--parts probe`` asks the device whether a GEMM's bits depend on more than its K order: each
shape's default tile against tiles of other heights, widths, K steps, warps and stages with the
same K slices (the same additions in the same order, other tensor-core instructions and
layouts); where every one gives the same bits, ``tile_for`` could pick a tile per row count
without breaking the invariance (it does not: one tile per shape).

``--sweep`` times candidate tiles (BLOCK_N, K slice, warps, stages) per shape and prints the
winner of a weighted time over the row counts (decode rows weigh most: W1/W3/W4 are decode
bound) as a ``PINNED`` entry for kernels/triton_invariant_gemm.py (pinning changes the bits of
the outputs, not their invariance). On a CPU (``--device cpu``, the interpreter) it only runs
tiny shapes through the same code (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

QWEN = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
        "lm_head": (151936, 1024)}
LLAMA = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
         "lm_head": (128256, 4096)}
ROWS = (1, 16, 64, 256, 2048)
WEIGHTS = {1: 4.0, 16: 2.0, 64: 2.0, 256: 3.0, 2048: 1.0}   # --sweep's weighted time


def timed(fn, device: str, calls: int = 20) -> float:
    """Microseconds per call, replayed from a CUDA graph of ``calls`` calls (eager on a CPU)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def gemm_table(shapes: dict, rows, dtype, device: str, sweep: bool) -> list[dict]:
    from headrace import kernels
    from headrace.kernels import triton_invariant_gemm as gemm
    from headrace.kernels.skinny_gemm import sm_count

    sms = sm_count(torch.device(device))
    out = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        x = torch.randn(max(rows), k, device=device).to(dtype)
        tile = gemm.tile_for(n, k, sms, x.element_size())
        full = gemm.linear(x, w)
        invariant = all(torch.equal(gemm.linear(x[:m], w), full[:m]) for m in rows)
        for m in rows:
            xm = x[:m].contiguous()
            det = timed(lambda: gemm.linear(xm, w), device)
            base = timed(lambda: kernels.linear(xm, w), device)
            out.append({"shape": name, "n": n, "k": k, "rows": m, "det_us": round(det, 1),
                        "default_us": round(base, 1), "x_default": round(det / base, 2),
                        "split": gemm.splits(tile, m, n, k, sms), "invariant": invariant,
                        "tile": list(vars(tile).values())})
        if sweep:
            out.append(_sweep(name, n, k, w, x, rows, sms, device))
    return out


def _candidates(k: int, wide: bool):
    from headrace.kernels.triton_invariant_gemm import Tile

    block_k = 32 if wide else 64
    for block_m, block_n in ((64, 64), (64, 128), (128, 128)):   # 128 rows: prefill's cuBLAS-like tile
        for slice_k in sorted({0, *(s for s in (256, 512, 1024, 2048) if s < k)}):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                if block_m == 128 and warps == 4:
                    continue   # a 128 x 128 float32 accumulator wants 8 warps
                yield Tile(block_m, block_n, block_k, warps, stages, slice_k)


def _sweep(name, n, k, w, x, rows, sms, device) -> dict:
    from headrace.kernels import triton_invariant_gemm as gemm

    results = []
    for tile in _candidates(k, x.element_size() > 2):
        try:
            full = gemm.linear(x, w, tile=tile)
            if not all(torch.equal(gemm.linear(x[:m], w, tile=tile), full[:m]) for m in rows):
                continue   # a tile whose rows change with the batch is no candidate
            times = {m: timed(lambda m=m: gemm.linear(x[:m], w, tile=tile), device) for m in rows}
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory)
            results.append({"tile": list(vars(tile).values()), "error": repr(exc)[:80]})
            continue
        score = sum(WEIGHTS.get(m, 1.0) * t for m, t in times.items())
        results.append({"tile": list(vars(tile).values()), "score": round(score, 1),
                        "us": {m: round(t, 1) for m, t in times.items()}})
    ok = sorted((r for r in results if "score" in r), key=lambda r: r["score"])
    best = ok[0] if ok else None
    return {"sweep": name, "n": n, "k": k, "best": best, "candidates": len(results),
            "pinned": None if best is None else f"PINNED[({n}, {k}, {sms})] = Tile(*{best['tile']})"}


def probe(n: int, k: int, dtype, device: str) -> dict:
    """Which other tiles with the default tile's K slices give its bits (see the docstring)."""
    import dataclasses

    from headrace.kernels import triton_invariant_gemm as gemm
    from headrace.kernels.skinny_gemm import sm_count

    w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
    x = torch.randn(96, k, device=device).to(dtype)
    base = gemm.tile_for(n, k, sm_count(torch.device(device)), x.element_size())
    slice_k = base.slice_k or k
    expected = gemm.linear(x, w, tile=base)
    same, differ = [], []
    for change in ({"block_m": 128}, {"block_m": 16}, {"block_n": 128 if base.block_n == 64 else 64},
                   {"block_n": 32}, {"block_k": 32}, {"warps": 8}, {"stages": 2}):
        tile = dataclasses.replace(base, slice_k=slice_k if base.slice_k else 0, **change)
        if slice_k % tile.block_k:
            continue
        try:
            got = gemm.linear(x, w, tile=tile)
        except Exception as exc:  # noqa: BLE001 - does not compile (shared memory)
            differ.append(f"{change} ({type(exc).__name__})")
            continue
        (same if torch.equal(got, expected) else differ).append(str(change))
    return {"tile": list(vars(base).values()), "same_bits": same, "other_bits": differ}


def attention_table(device: str, dtype, quick: bool) -> list[dict]:
    from headrace.kernels import (triton_attention, triton_invariant_attention as det,
                                  triton_invariant_tile as tile)

    heads, kv_heads, head_dim, bs = (16, 8, 128, 16) if device == "cuda" else (4, 2, 32, 16)
    cases = [("decode", b, ctx) for b in (1, 64, 256) for ctx in (1024, 4096, 16384)]
    cases += [("prefill", 2048, ctx) for ctx in (2048, 10240)]
    if quick:
        cases = [("decode", 2, 300), ("prefill", 64, 200)]
    out = []
    for kind, size, ctx in cases:
        seqs = size if kind == "decode" else 1
        blocks_per = -(-ctx // bs)
        cache = torch.randn(2, seqs * blocks_per + 1, bs, kv_heads, head_dim, device=device).to(dtype)
        tables = torch.arange(seqs * blocks_per, dtype=torch.int32, device=device).view(seqs, blocks_per)
        tokens = seqs if kind == "decode" else size
        q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
        lens = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
        qsl = (torch.arange(seqs + 1, dtype=torch.int32, device=device) if kind == "decode"
               else torch.tensor([0, size], dtype=torch.int32, device=device))
        hints = dict(decode_only=True) if kind == "decode" else dict(max_query_len=size)
        args = (q, cache, qsl, lens, tables, 0.08)
        run_det = lambda: det.paged_attention(*args, **hints)  # noqa: E731
        run_base = lambda: triton_attention.paged_attention(*args, **hints)  # noqa: E731
        d, b = timed(run_det, device), timed(run_base, device)
        close = torch.allclose(run_det().float(), run_base().float(), atol=2e-2, rtol=2e-2)
        out.append({"attention": kind, "batch" if kind == "decode" else "tokens": size, "context": ctx,
                    "det_us": round(d, 1), "default_us": round(b, 1), "x_default": round(d / b, 2),
                    "close": close, "split_tokens": tile.SPLIT_TOKENS})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="qwen3,llama", help="whose shapes: qwen3, llama")
    ap.add_argument("--sweep", action="store_true", help="sweep GEMM tiles per shape (PINNED lines)")
    ap.add_argument("--parts", default="gemm,attention", help="gemm, attention, probe")
    ap.add_argument("--row-tiles", action="store_true",
                    help="time the GEMM with HOPPER_ROW_TILES (a tile per row count) on this device")
    args = ap.parse_args()
    if args.row_tiles and args.device == "cuda":
        from headrace.kernels import triton_invariant_gemm as gemm
        from headrace.kernels.skinny_gemm import sm_count

        gemm.ROW_TILES[sm_count(torch.device("cuda"))] = gemm.HOPPER_ROW_TILES
    quick = args.device != "cuda"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = ROWS if not quick else (1, 3)
    parts = args.parts.split(",")
    if "gemm" in parts:
        for model in args.models.split(","):
            shapes = {"qwen3": QWEN, "llama": LLAMA}[model]
            if quick:
                shapes = {"tiny": (40, 96)}
            for row in gemm_table(shapes, rows, dtype, args.device, args.sweep):
                print(json.dumps({"bench": "det_gemm", "model": model, **row}), flush=True)
            if quick:
                break
    if "probe" in parts:
        for model in args.models.split(","):
            shapes = {"qwen3": QWEN, "llama": LLAMA}[model]
            for name, (n, k) in ({"tiny": (40, 96)} if quick else shapes).items():
                print(json.dumps({"bench": "det_gemm_probe", "model": model, "shape": name,
                                  **probe(n, k, dtype, args.device)}), flush=True)
            if quick:
                break
    if "attention" in parts:
        for row in attention_table(args.device, dtype, quick):
            print(json.dumps({"bench": "det_attention", **row}), flush=True)


if __name__ == "__main__":
    main()
