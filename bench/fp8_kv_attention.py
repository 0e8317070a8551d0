"""Paged attention over an FP8 (e4m3) KV cache against the same over bf16, on the GPU: the
decode kernel's tile and widening variants side by side, and causal prefill over a cached
prefix, for W1's (Qwen3-0.6B) and W3's (Llama-3.1-8B) layouts.

Decode is timed as the engine runs it (``bench.kernels.graph_ms``: CUDA-graph replay over distinct
batches, past the L2 cache); TB/s counts the bytes of each cache (bf16's twice FP8's), so a faster
FP8 kernel shows as lower µs at about the same TB/s. Each row: bf16 (the engine's bf16 tile), then
FP8 variants: widened to float16 or to the query's dtype (``triton_flash.FP8_COMPUTE``), BLOCK_N /
warps / stages of the decode kernel, and V stored transposed within each block (the engine's FP8
layout, ``headrace.kernels.kv_layout``) or token-major (``tok-V``: bf16's layout, the engine's
before); the engine's FP8 variant is the first; ``best`` names the fastest. Every variant is checked
against the bf16 kernel on the dequantised cache first. The prefill rows time causal chunks over
bf16, FP8 and FP8 with a token-major V.

A context that is not a multiple of the decode tile (64 keys) ends in a partial tile, which
the FP8 kernel read a byte at a time before 2026-12-03 (its V masked along the keys): the
default contexts hold one of each (1,000 and 2,048); whole-tile contexts alone hide that tile.

    python -m bench.fp8_kv_attention [--batches 64,256] [--contexts 1000,2048]
        [--tiles engine,64/2/4,64/1/5] [--bf16-tiles 64/4/3] [--layouts llama3.1-8b] [--no-prefill]

``--tiles`` times these FP8 tiles (BLOCK_N/warps/stages; ``engine``: the engine's for the row's
batch) instead of the variants; ``--bf16-tiles`` times bf16 tiles beside the engine's (the
``bf16`` column, every ratio's base).
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels import BLOCK, LAYOUTS, _metadata, _time_ms, graph_ms
from headrace.kernels import kv_layout, triton_attention, triton_decode, triton_flash

K_SCALE, V_SCALE = 0.02, 0.02
# (label, FP8_COMPUTE, (BLOCK_N, warps, stages), V transposed); the first is the engine's
ENGINE = "f16 engine"   # the engine's tile for the row's batch: triton_decode.decode_config
FP8_VARIANTS = [(ENGINE, "float16", None, True), ("f16 64/4/3", "float16", (64, 4, 3), True),
                ("f16 64/4/4", "float16", (64, 4, 4), True), ("f16 128/4/3", "float16", (128, 4, 3), True),
                ("tok-V f16 128/4/3", "float16", (128, 4, 3), False)]
# (session 18 also measured 128/4/4, 32/4/4, 128/8/3 and 256/8/2 beside 64/2/4: all slower)


def _decode_calls(cache, heads, batch, ctx, compute, config, scale, v_t=False):
    """Distinct batches of equal contexts (enough to sweep past the L2 cache); ``v_t``: the
    cache's values are stored transposed (an FP8 cache given as ``kv_layout.store`` made it)."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * cache.element_size()
    calls, saved = [], triton_flash.FP8_COMPUTE
    triton_flash.FP8_COMPUTE = compute
    try:
        for _ in range(min(16, max(4, (512 << 20) // kv_bytes))):
            starts, seq_lens, tables = _metadata([1] * batch, [ctx] * batch, cache.shape[1],
                                                 cache.device)
            query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=cache.device)
            launch = triton_flash.Launch(query, cache, tables, scale, K_SCALE, V_SCALE)
            launch.v_t = v_t
            out = torch.empty_like(query)
            calls.append(lambda a=(launch, seq_lens, tables, out, None, None, config):
                         triton_decode.decode(*a) or a[3])
    finally:
        triton_flash.FP8_COMPUTE = saved
    return calls, kv_bytes


def decode_row(layout, batch, ctx, bf16_tiles=()) -> str:
    heads, kv_heads, head_dim = LAYOUTS[layout]
    blocks = batch * -(-ctx // BLOCK) + 16   # (a context past a block boundary takes a block more)
    bf16 = torch.randn(2, blocks, BLOCK, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scales = torch.tensor([K_SCALE, V_SCALE], device="cuda").view(2, 1, 1, 1, 1)
    fp8 = (bf16.float() / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    bf16 = (fp8.float() * scales).to(torch.bfloat16)       # the same values in both caches
    stored = {False: fp8, True: kv_layout.store(fp8)}      # token-major V, transposed V
    scale = head_dim ** -0.5
    base_calls, base_bytes = _decode_calls(bf16, heads, batch, ctx, "query", None, scale)
    graph_ms(base_calls)   # a row's first timing ran ~5% slow on the H200 (2026-12-03): not kept
    base = graph_ms(base_calls) * 1e3
    cells, best = [f"{base:7.1f} ({base_bytes / base / 1e6:4.2f})"], ("bf16", base)
    for tile in bf16_tiles:    # more bf16 tiles beside the engine's
        calls, nbytes = _decode_calls(bf16, heads, batch, ctx, "query", tile, scale)
        us = graph_ms(calls) * 1e3
        cells.append(f"{us:7.1f} ({nbytes / us / 1e6:4.2f}; {us / base:4.2f}x)")
        best = min(best, ("bf16 " + "/".join(map(str, tile)), us), key=lambda b: b[1])
    for label, compute, config, v_t in FP8_VARIANTS:
        calls, nbytes = _decode_calls(stored[v_t], heads, batch, ctx, compute, config, scale, v_t)
        us = graph_ms(calls) * 1e3
        cells.append(f"{us:7.1f} ({nbytes / us / 1e6:4.2f}; {us / base:4.2f}x)")
        best = min(best, (label, us), key=lambda b: b[1])
    return f"{layout:>12} {batch:>5} {ctx:>6} | " + " | ".join(cells) + f" | best {best[0]}"


def check() -> None:
    """Each FP8 variant's decode equals the bf16 kernel over the dequantised cache."""
    heads, kv_heads, head_dim = LAYOUTS["llama3.1-8b"]
    starts, seq_lens, tables = _metadata([1] * 8, [700, 1, 64, 3000, 5, 16, 900, 257], 512, "cuda")
    cache = torch.randn(2, 512, BLOCK, kv_heads, head_dim, device="cuda") * 0.05
    scales = torch.tensor([K_SCALE, V_SCALE], device="cuda").view(2, 1, 1, 1, 1)
    fp8 = (cache / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (fp8.float() * scales).to(torch.bfloat16)
    query = torch.randn(8, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    want = triton_attention.paged_attention(query, deq, starts, seq_lens, tables, head_dim ** -0.5,
                                            decode_only=True).float()
    saved = triton_flash.FP8_COMPUTE
    stored = {False: fp8, True: kv_layout.store(fp8)}
    for label, compute, config, v_t in FP8_VARIANTS:
        triton_flash.FP8_COMPUTE = compute
        launch = triton_flash.Launch(query, stored[v_t], tables, head_dim ** -0.5, K_SCALE, V_SCALE)
        launch.v_t = v_t
        out = torch.empty_like(query)
        triton_decode.decode(launch, seq_lens, tables, out, None, None, config)
        err = (out.float() - want).abs().max().item()
        print(f"check fp8 decode {label}: max |diff| vs bf16 over the dequantised cache {err:.4f}")
        assert err < 2e-2, label
    triton_flash.FP8_COMPUTE = saved


def prefill_row(layout, q_len, ctx) -> str:
    """Causal chunks of q_len tokens over ctx - q_len cached ones (TFLOP/s): bf16, FP8 (V
    transposed), FP8 with a token-major V."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    batch = max(1, 16384 // q_len)
    cells = []
    for dtype, v_t in ((torch.bfloat16, False), (torch.float8_e4m3fn, True), (torch.float8_e4m3fn, False)):
        cache = torch.randn(2, batch * -(-ctx // BLOCK) + 16, BLOCK, kv_heads, head_dim,
                            device="cuda").to(dtype)
        starts, seq_lens, tables = _metadata([q_len] * batch, [ctx] * batch, cache.shape[1], "cuda")
        query = torch.randn(batch * q_len, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        launch = triton_flash.Launch(query, cache, tables, head_dim ** -0.5, K_SCALE, V_SCALE)
        launch.v_t = v_t
        out = torch.empty_like(query)
        ms = _time_ms(lambda: triton_attention.prefill(launch, starts, seq_lens, tables, out, 0, q_len))
        pairs = batch * q_len * (ctx - q_len) + batch * q_len * (q_len + 1) / 2
        cells.append(f"{4 * heads * head_dim * pairs / ms / 1e9:6.1f}")
        cache = launch = None   # (freed before the next; ``del`` reads as undefined in the lambda)
    return (f"{layout:>12} prefill {q_len} over {ctx}: TFLOP/s bf16 {cells[0]}, fp8 {cells[1]}, "
            f"fp8 tok-V {cells[2]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--contexts", default="1000,2048")
    ap.add_argument("--tiles", default=None, help="FP8 decode tiles BLOCK_N/warps/stages to time "
                    "(V transposed, float16) instead of the variants above, e.g. engine,64/2/4,64/1/5")
    ap.add_argument("--bf16-tiles", default="", help="bf16 decode tiles timed beside the engine's")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    if args.tiles:   # ("engine": the engine's tile for each row's batch)
        FP8_VARIANTS[:] = [(ENGINE, "float16", None, True) if t == "engine" else
                           ("f16 " + t, "float16", tuple(map(int, t.split("/"))), True)
                           for t in args.tiles.split(",")]
    bf16_tiles = [tuple(map(int, t.split("/"))) for t in args.bf16_tiles.split(",") if t]
    check()
    print(f"\ndecode: µs per call (TB/s of its cache; x bf16)\n{'layout':>12} {'batch':>5} "
          f"{'ctx':>6} | {'bf16':>14} | " + " | ".join(
              f"{name:>22}" for name in ["bf16 " + "/".join(map(str, t)) for t in bf16_tiles]
              + [v[0] for v in FP8_VARIANTS]))
    layouts = args.layouts.split(",")
    for layout in layouts:
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                print(decode_row(layout, batch, ctx, bf16_tiles), flush=True)
    for layout in layouts if not args.no_prefill else ():
        print(prefill_row(layout, 2048, 4096), flush=True)


if __name__ == "__main__":
    main()
