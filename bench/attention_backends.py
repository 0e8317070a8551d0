"""The attention backends side by side on a CUDA GPU (written for the H200): our Triton kernels
and flash-attn-4 (``--attention-backend``, kernels/attention_policy.py).

* prefill: causal TFLOP/s of one fresh prompt of 1k..32k tokens: Triton (16-token blocks),
  flash-attn-4 dense varlen (contiguous K/V, ``cu_seqlens_k``) and paged through our cache
  layout with 16- and 128-token pages; then a 2048-token chunk over cached prefixes (what
  chunked prefill runs), with the policy's current choice for each row;
* decode: TB/s of the K/V read on W1's own decode batches (Qwen3-0.6B heads): Triton from a
  CUDA graph (as the engine runs it), flash-attn-4 eagerly (its calls stay outside graphs);
* host: microseconds of host work per call at short lengths (calls back to back, the device
  idle), and where flash-attn-4's goes (cProfile of its call);
* last, a short table and the crossover the prefill table suggests for
  ``FLASH_ATTN_CROSSOVER_TOKENS``.

Timed with ``triton.testing.do_bench`` (median of eager calls: host work included where it
exceeds the kernel's). bf16, random inputs, blocks shuffled. Not a test:
``python -m bench.attention_backends [--quick] [--layouts qwen3-0.6b,llama3.1-8b]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import triton

from bench.kernels import LAYOUTS, graph_ms, w1_decode_batches
from headrace.kernels import attention_policy, flash_attn4, reference, triton_attention

DTYPE = torch.bfloat16


def _paged(q_lens, ctx_lens, kv_heads, head_dim, block, device, fill=True):
    """(cache, query_start_loc, seq_lens, block tables) over shuffled blocks."""
    widths = [-(-c // block) for c in ctx_lens]
    total = sum(widths)
    cache = (torch.randn if fill else torch.zeros)(2, total, block, kv_heads, head_dim, dtype=DTYPE,
                                                   device=device)
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(widths), dtype=torch.int32, device=device)
    for i, ids in enumerate(perm.split(widths)):
        tables[i, :len(ids)] = ids
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return cache, qsl, torch.tensor(ctx_lens, dtype=torch.int32, device=device), tables


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _flops(q_len: int, ctx: int, heads: int, head_dim: int) -> float:
    """4 * H * D * (visible query-key pairs) of a causal chunk of q_len after ctx - q_len."""
    pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2
    return 4 * heads * head_dim * pairs


def check(device) -> None:
    heads, kv_heads, head_dim = LAYOUTS["llama3.1-8b"]
    for block in (16, 128):
        q_lens, ctx = [1, 1, 300, 77], [900, 40, 300, 1200]
        cache, qsl, lens, tables = _paged(q_lens, ctx, kv_heads, head_dim, block, device)
        query = torch.randn(sum(q_lens), heads, head_dim, dtype=DTYPE, device=device)
        plan = flash_attn4.plan(qsl, lens, tables, 2, max(q_lens))
        got = flash_attn4.paged_attention(query, cache, plan, head_dim ** -0.5,
                                          triton_attention.paged_attention)
        want = reference.paged_attention(query, cache, qsl, lens, tables, head_dim ** -0.5)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    print("check: flash-attn-4 (mixed steps, 16- and 128-token pages) matches the reference")


def prefill_row(heads, kv_heads, head_dim, q_len, ctx, device, dense=True) -> dict:
    """TFLOP/s of one chunk of q_len tokens ending a context of ctx, per backend."""
    varlen, scale, out = flash_attn4.load(), head_dim ** -0.5, {}
    query = torch.randn(q_len, heads, head_dim, dtype=DTYPE, device=device)
    flops = _flops(q_len, ctx, heads, head_dim)
    for block in (16, 128):
        cache, qsl, lens, tables = _paged([q_len], [ctx], kv_heads, head_dim, block, device)
        plan = flash_attn4.plan(qsl, lens, tables, 0, q_len)
        if block == 16:
            out["triton"] = flops / _ms(lambda: triton_attention.paged_attention(
                query, cache, qsl, lens, tables, scale, max_query_len=q_len)) / 1e9
        out[f"fa4-paged{block}"] = flops / _ms(lambda: varlen(
            **flash_attn4.varlen_kwargs(query, cache, plan, scale))) / 1e9
    if dense:
        k, v = (torch.randn(ctx, kv_heads, head_dim, dtype=DTYPE, device=device) for _ in range(2))
        cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, ctx], dtype=torch.int32, device=device)
        out["fa4-dense"] = flops / _ms(lambda: varlen(
            query, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=q_len,
            max_seqlen_k=ctx, softmax_scale=scale, causal=True)) / 1e9
    return out


COLUMNS = ("triton", "fa4-dense", "fa4-paged16", "fa4-paged128")


def bench_prefill(layouts, lengths, device) -> dict:
    """Dense prompts, then 2048-token chunks over cached prefixes; returns the prompt rows."""
    rows, auto = {}, attention_policy.resolve("auto", "cuda", None)
    for name in layouts:
        heads, kv_heads, head_dim = LAYOUTS[name]
        print(f"\nprefill {name} ({heads}/{kv_heads} heads, hd {head_dim}), causal TFLOP/s")
        print(f"{'tokens':>7} {'cached':>7} " + "".join(f"{c:>13}" for c in COLUMNS) + "  auto picks")
        for q_len, prefix in [(n, 0) for n in lengths] + [(2048, p) for p in (6144, 14336, 30720)]:
            row = prefill_row(heads, kv_heads, head_dim, q_len, q_len + prefix, device)
            if prefix == 0:
                rows[(name, q_len)] = row
            pick = auto.choose(False, 0, q_len * prefix + q_len * (q_len + 1) // 2)
            print(f"{q_len:7d} {prefix:7d} " + "".join(f"{row.get(c, 0):13.1f}" for c in COLUMNS)
                  + f"  {pick}")
    return rows


def bench_decode(device, quick: bool) -> dict:
    """W1's decode batches (Qwen3-0.6B heads): TB/s of the K/V read."""
    heads, kv_heads, head_dim = LAYOUTS["qwen3-0.6b"]
    varlen, scale, result = flash_attn4.load(), head_dim ** -0.5, {"triton": [], "fa4-paged16": []}
    steps = [50, 500, 950] if quick else [50, 300, 500, 700, 950]
    print("\ndecode, W1 batches (qwen3-0.6b heads): step batch mean_ctx  TB/s triton (graph) "
          " fa4-paged16 (eager)")
    for step, ctx in zip(steps, w1_decode_batches(steps)):
        cache, qsl, lens, tables = _paged([1] * len(ctx), ctx, kv_heads, head_dim, 16, device)
        query = torch.randn(len(ctx), heads, head_dim, dtype=DTYPE, device=device)
        kv_bytes = 2 * sum(ctx) * kv_heads * head_dim * 2
        ms_t = graph_ms([lambda: triton_attention.paged_attention(
            query, cache, qsl, lens, tables, scale, decode_only=True)])
        plan = flash_attn4.plan(qsl, lens, tables, 0, 1)
        ms_f = _ms(lambda: varlen(**flash_attn4.varlen_kwargs(query, cache, plan, scale)))
        result["triton"].append(kv_bytes / ms_t / 1e9)
        result["fa4-paged16"].append(kv_bytes / ms_f / 1e9)
        print(f"{step:5d} {len(ctx):5d} {sum(ctx) // len(ctx):8d} {result['triton'][-1]:10.2f}"
              f" ({ms_t * 1e3:6.1f} us) {result['fa4-paged16'][-1]:8.2f} ({ms_f * 1e3:6.1f} us)")
    return {k: sum(v) / len(v) for k, v in result.items()}


def host_cost(device, calls: int = 200) -> dict:
    """Host microseconds per call of a 16-token prompt, back to back (device mostly idle)."""
    heads, kv_heads, head_dim = LAYOUTS["qwen3-0.6b"]
    cache, qsl, lens, tables = _paged([16], [16], kv_heads, head_dim, 16, device)
    query = torch.randn(16, heads, head_dim, dtype=DTYPE, device=device)
    plan, scale = flash_attn4.plan(qsl, lens, tables, 0, 16), head_dim ** -0.5
    fns = {"triton": lambda: triton_attention.paged_attention(query, cache, qsl, lens, tables, scale,
                                                              max_query_len=16),
           "fa4-paged16": lambda: flash_attn4.paged_attention(query, cache, plan, scale, None)}
    out = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fns["fa4-paged16"]()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    print("\nhost us per call (16 tokens): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
    print(f"where flash-attn-4's host time goes ({calls} calls, by own time):")
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
    return out


def crossover(rows: dict, layout: str, lengths) -> int | None:
    """Shortest prompt length from which flash-attn-4 (paged, 16) beats Triton at every longer
    length of the table."""
    best = None
    for n in sorted(lengths, reverse=True):
        row = rows[(layout, n)]
        if row["fa4-paged16"] < row["triton"]:
            break
        best = n
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and decode batches")
    parser.add_argument("--layouts", default="qwen3-0.6b,llama3.1-8b",
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    device = torch.device("cuda")
    why = flash_attn4.unusable(device, DTYPE, DTYPE, 128)
    if why:
        raise SystemExit(f"bench.attention_backends: {why}")
    layouts = args.layouts.split(",")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(device), "torch", torch.__version__, "triton", triton.__version__)
    check(device)
    lengths = [1024, 2048, 4096, 8192, 16384, 32768] if args.quick else [
        512, 1024, 2048, 4096, 8192, 16384, 32768]
    rows = bench_prefill(layouts, lengths, device)
    decode = bench_decode(device, args.quick)
    host = host_cost(device)
    print("\nsummary (prefill TFLOP/s; decode TB/s, W1 mean; host us/call at 16 tokens)")
    print(f"{'layout':<12} {'tokens':>6} " + "".join(f"{c:>13}" for c in COLUMNS))
    for (name, n), row in rows.items():
        if n in (1024, 8192, 16384, 32768):
            print(f"{name:<12} {n:6d} " + "".join(f"{row[c]:13.1f}" for c in COLUMNS))
    print(f"decode TB/s  triton {decode['triton']:.2f}  fa4-paged16 {decode['fa4-paged16']:.2f}")
    print(f"host us/call triton {host['triton']:.1f}  fa4-paged16 {host['fa4-paged16']:.1f}")
    for name in layouts:
        gain = [rows[(name, n)]["fa4-paged128"] / rows[(name, n)]["fa4-paged16"]
                for n in lengths if n >= 8192]
        print(f"pages {name}: 128-token pages over 16, 8k-32k: x{min(gain):.2f}-{max(gain):.2f}")
    for name in layouts:
        print(f"crossover {name}: flash-attn-4 wins from {crossover(rows, name, lengths)} tokens "
              f"(FLASH_ATTN_CROSSOVER_TOKENS = {attention_policy.FLASH_ATTN_CROSSOVER_TOKENS})")


if __name__ == "__main__":
    main()
