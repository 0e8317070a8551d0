"""Paged attention over an FP8 (e4m3) KV cache against the same over bf16, on the GPU: the
decode kernel's tile and widening variants side by side, and causal prefill over a cached
prefix, for W1's (Qwen3-0.6B) and W3's (Llama-3.1-8B) layouts.

Decode is timed as the engine runs it (``bench.kernels.graph_ms``: CUDA-graph replay over
distinct batches, past the L2 cache); TB/s counts the bytes of each cache (bf16's twice FP8's),
so a faster FP8 kernel shows as lower µs at about the same TB/s. Each row: bf16 (the engine's
bf16 tile), then FP8 variants: widened to float16 or to the query's dtype
(``triton_flash.FP8_COMPUTE``), BLOCK_N / warps / stages of the decode kernel; the engine's
FP8 variant is the first; ``best`` names the fastest. Every variant is checked against the
bf16 kernel on the dequantised cache first.

    python -m bench.fp8_kv_attention [--batches 64,256] [--contexts 1024,2048]
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels import BLOCK, LAYOUTS, _metadata, _time_ms, graph_ms
from kernels import triton_attention, triton_decode, triton_flash

K_SCALE, V_SCALE = 0.02, 0.02
# (label, FP8_COMPUTE, (BLOCK_N, warps, stages)); the first is the engine's
FP8_VARIANTS = [("f16 128/4/3", "float16", None), ("f16 64/4/3", "float16", (64, 4, 3)),
                ("f16 128/8/3", "float16", (128, 8, 3)), ("f16 256/8/2", "float16", (256, 8, 2)),
                ("bf16 64/4/3 (old)", "query", (64, 4, 3))]


def _decode_calls(cache, heads, batch, ctx, compute, config, scale):
    """Distinct batches of equal contexts (enough to sweep past the L2 cache)."""
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
            out = torch.empty_like(query)
            calls.append(lambda a=(launch, seq_lens, tables, out, None, None, config):
                         triton_decode.decode(*a) or a[3])
    finally:
        triton_flash.FP8_COMPUTE = saved
    return calls, kv_bytes


def decode_row(layout, batch, ctx) -> str:
    heads, kv_heads, head_dim = LAYOUTS[layout]
    blocks = batch * ctx // BLOCK + 16
    bf16 = torch.randn(2, blocks, BLOCK, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scales = torch.tensor([K_SCALE, V_SCALE], device="cuda").view(2, 1, 1, 1, 1)
    fp8 = (bf16.float() / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    bf16 = (fp8.float() * scales).to(torch.bfloat16)       # the same values in both caches
    scale = head_dim ** -0.5
    base_calls, base_bytes = _decode_calls(bf16, heads, batch, ctx, "query", None, scale)
    base = graph_ms(base_calls) * 1e3
    cells, best = [f"{base:7.1f} ({base_bytes / base / 1e6:4.2f})"], ("bf16", base)
    for label, compute, config in FP8_VARIANTS:
        calls, nbytes = _decode_calls(fp8, heads, batch, ctx, compute, config, scale)
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
    for label, compute, config in FP8_VARIANTS:
        triton_flash.FP8_COMPUTE = compute
        launch = triton_flash.Launch(query, fp8, tables, head_dim ** -0.5, K_SCALE, V_SCALE)
        out = torch.empty_like(query)
        triton_decode.decode(launch, seq_lens, tables, out, None, None, config)
        err = (out.float() - want).abs().max().item()
        print(f"check fp8 decode {label}: max |diff| vs bf16 over the dequantised cache {err:.4f}")
        assert err < 2e-2, label
    triton_flash.FP8_COMPUTE = saved


def prefill_row(layout, q_len, ctx) -> str:
    """Causal chunks of q_len tokens over ctx - q_len cached ones (TFLOP/s), bf16 vs FP8."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    batch = max(1, 16384 // q_len)
    cells = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.randn(2, batch * ctx // BLOCK + 16, BLOCK, kv_heads, head_dim,
                            device="cuda").to(dtype)
        starts, seq_lens, tables = _metadata([q_len] * batch, [ctx] * batch, cache.shape[1], "cuda")
        query = torch.randn(batch * q_len, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        ms = _time_ms(lambda: triton_attention.paged_attention(
            query, cache, starts, seq_lens, tables, head_dim ** -0.5, max_query_len=q_len,
            k_scale=K_SCALE, v_scale=V_SCALE))
        pairs = batch * q_len * (ctx - q_len) + batch * q_len * (q_len + 1) / 2
        cells.append(f"{4 * heads * head_dim * pairs / ms / 1e9:6.1f}")
        del cache
    return f"{layout:>12} prefill {q_len} over {ctx}: TFLOP/s bf16 {cells[0]}, fp8 {cells[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--contexts", default="1024,2048")
    args = ap.parse_args()
    check()
    print(f"\ndecode: µs per call (TB/s of its cache; x bf16)\n{'layout':>12} {'batch':>5} "
          f"{'ctx':>6} | {'bf16':>14} | " + " | ".join(f"{v[0]:>22}" for v in FP8_VARIANTS))
    for layout in LAYOUTS:
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                print(decode_row(layout, batch, ctx), flush=True)
    for layout in LAYOUTS:
        print(prefill_row(layout, 2048, 4096), flush=True)


if __name__ == "__main__":
    main()
