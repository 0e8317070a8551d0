"""Benchmark of the Triton paged attention kernels on a CUDA GPU (written for the H200).

Prints achieved TB/s of paged decode attention (bytes = all K/V of the batch + q + out) and
TFLOP/s of causal prefill attention (4 * H * D * causal score count), after checking both
kernels against ``kernels.reference`` on small ragged cases. bf16, block size 16, KV blocks in
shuffled order. Not a test: ``python bench/kernels.py [--quick | --sweep | --layout | --ragged |
--prefill-w1]`` on the GPU; --sweep times the launch configurations at the top of
kernels/triton_attention.py and kernels/triton_decode.py, --ragged and --prefill-w1 use W1's own decode batches and first
prefill step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys

import torch
import triton
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timing import graph_ms  # noqa: E402
from kernels import reference, triton_attention, triton_decode  # noqa: E402

LAYOUTS = {"qwen3-0.6b": (16, 8, 128), "llama3.1-8b": (32, 8, 128)}  # q heads, kv heads, head_dim
BLOCK = 16
DTYPE = torch.bfloat16


def _metadata(q_lens, ctx_lens, num_blocks, device):
    """query_start_loc, seq_lens and block tables over distinct, shuffled blocks."""
    widths = [-(-c // BLOCK) for c in ctx_lens]
    perm = torch.randperm(num_blocks, device=device)[:sum(widths)].to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(widths), dtype=torch.int32, device=device)
    for i, ids in enumerate(perm.split(widths)):
        tables[i, :len(ids)] = ids
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                          device=device)
    return starts, torch.tensor(ctx_lens, dtype=torch.int32, device=device), tables


def check(device) -> None:
    """Both kernels against the reference on ragged batches (NaN in every unwritten slot)."""
    for name, (heads, kv_heads, head_dim) in LAYOUTS.items():
        for q_lens, ctx_lens in (([1] * 4, [1, 16, 100, 3000]), ([7, 1, 200], [7, 64, 900])):
            cache = torch.full((2, 400, BLOCK, kv_heads, head_dim), float("nan"), dtype=DTYPE,
                               device=device)
            starts, seq_lens, tables = _metadata(q_lens, ctx_lens, 400, device)
            for i, ctx in enumerate(ctx_lens):
                slots = (tables[i].long()[:, None] * BLOCK + torch.arange(BLOCK, device=device))
                kv = torch.randn(2, ctx, kv_heads, head_dim, dtype=DTYPE, device=device)
                reference.write_kv(cache, kv[0], kv[1], slots.flatten()[:ctx])
            query = torch.randn(sum(q_lens), heads, head_dim, dtype=DTYPE, device=device)
            args = (query, cache, starts, seq_lens, tables, head_dim ** -0.5)
            torch.testing.assert_close(triton_attention.paged_attention(*args),
                                       reference.paged_attention(*args), atol=2e-2, rtol=2e-2)
        print(f"check {name}: decode and mixed prefill match the reference")


def _time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def decode_point(cache, heads, batch, ctx) -> tuple[float, float, int]:
    """(TB/s, microseconds, kv splits) of a decode batch of equal contexts; enough distinct
    batches (block tables, queries) per graph to sweep well past the L2 cache."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
    calls = []
    for _ in range(min(32, max(4, (512 << 20) // kv_bytes))):
        starts, seq_lens, tables = _metadata([1] * batch, [ctx] * batch, cache.shape[1],
                                             cache.device)
        query = torch.randn(batch, heads, head_dim, dtype=DTYPE, device=cache.device)
        calls.append(lambda q=query, a=(cache, starts, seq_lens, tables, head_dim ** -0.5):
                     triton_attention.paged_attention(q, *a, decode_only=True))
    ms = graph_ms(calls)
    splits = triton_attention.num_decode_splits(batch, kv_heads, tables.shape[1] * BLOCK,
                                                cache.device)
    return (kv_bytes + 4 * query.numel()) / ms / 1e9, ms * 1e3, splits


def prefill_point(heads, kv_heads, head_dim, n, batch, device) -> float:
    """TFLOP/s of fresh causal prompts of length n."""
    cache = torch.randn(2, batch * n // BLOCK, BLOCK, kv_heads, head_dim, dtype=DTYPE,
                        device=device)
    starts, seq_lens, tables = _metadata([n] * batch, [n] * batch, cache.shape[1], device)
    query = torch.randn(batch * n, heads, head_dim, dtype=DTYPE, device=device)
    ms = _time_ms(lambda: triton_attention.paged_attention(
        query, cache, starts, seq_lens, tables, head_dim ** -0.5, max_query_len=n))
    return 4 * batch * heads * head_dim * n * (n + 1) / 2 / ms / 1e9


def sdpa_point(heads, head_dim, n, batch, device) -> float:
    """TFLOP/s of torch's SDPA (flash attention, contiguous K/V with the heads expanded)."""
    q, k, v = (torch.randn(batch, heads, n, head_dim, dtype=DTYPE, device=device) for _ in range(3))
    ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    return 4 * batch * heads * head_dim * n * (n + 1) / 2 / ms / 1e9


def bench_decode(batches, contexts, device) -> None:
    cache = torch.randn(2, max(batches) * max(contexts) // BLOCK, BLOCK, 8, 128, dtype=DTYPE,
                        device=device)  # both layouts have 8 kv heads of 128
    for name, (heads, kv_heads, head_dim) in LAYOUTS.items():
        print(f"\ndecode {name} ({heads}/{kv_heads} heads, hd {head_dim}): TB/s (us, kv splits)")
        print("batch " + "".join(f"{c:>22}" for c in contexts))
        for batch in batches:
            cells = ["%6.2f (%7.1f, %2d)" % decode_point(cache, heads, batch, ctx)
                     for ctx in contexts]
            print(f"{batch:5d} " + "".join(f"{c:>22}" for c in cells))


def bench_prefill(lengths, tokens, device) -> None:
    """Fresh prompts of one length, tokens // length of them, against torch's SDPA."""
    for name, (heads, kv_heads, head_dim) in LAYOUTS.items():
        print(f"\nprefill {name} ({heads}/{kv_heads} heads, hd {head_dim}), causal: TFLOP/s")
        print(f"{'length':>7} {'batch':>5} {'triton':>8} {'sdpa':>8}")
        for n in lengths:
            batch = max(1, tokens // n)
            ours = prefill_point(heads, kv_heads, head_dim, n, batch, device)
            sdpa = sdpa_point(heads, head_dim, n, batch, device)
            print(f"{n:7d} {batch:5d} {ours:8.1f} {sdpa:8.1f}")


def sweep(device) -> None:
    """Launch configurations of both kernels at representative points (Llama-3.1-8B layout)."""
    cache = torch.randn(2, 64 * 8192 // BLOCK, BLOCK, 8, 128, dtype=DTYPE, device=device)
    points = [(1, 32768), (16, 8192), (64, 4096), (256, 1024)]
    print("\ndecode sweep: block_n warps stages -> TB/s at (batch, context)", points)
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                triton_decode.DECODE_BLOCK_N = block_n
                triton_decode.DECODE_WARPS, triton_decode.DECODE_STAGES = warps, stages
                tbps = [decode_point(cache, 32, b, min(c, 64 * 8192 // b))[0] for b, c in points]
                print(block_n, warps, stages, " ".join(f"{t:6.2f}" for t in tbps))
    del cache
    print("\nprefill sweep: block_m block_n warps stages -> TFLOP/s at lengths 2048, 8192")
    for block_m in (64, 128, 256):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    ta = triton_attention
                    ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N = block_m, block_n
                    ta.PREFILL_WARPS, ta.PREFILL_STAGES = warps, stages
                    try:
                        tf = [prefill_point(32, 8, 128, n, 16384 // n, device)
                              for n in (2048, 8192)]
                    except OutOfResources as e:  # shared memory
                        print(block_m, block_n, warps, stages, type(e).__name__)
                        continue
                    print(block_m, block_n, warps, stages, " ".join(f"{t:7.1f}" for t in tf))


def layout_sweep(device) -> None:
    """W1's decode shapes (Qwen3-0.6B heads, block 16) with the cache slot-major (the engine's
    [2, blocks, block_size, kv_heads, head_dim]) and head-major (a block's slots of one head
    contiguous; the same logical shape through a transposed view), over launch configurations."""
    points = [(256, 700), (128, 1000), (32, 1500)]
    blocks = 256 * 1024 // BLOCK
    caches = {"slot-major": torch.randn(2, blocks, BLOCK, 8, 128, dtype=DTYPE, device=device),
              "head-major": torch.randn(2, blocks, 8, BLOCK, 128, dtype=DTYPE,
                                        device=device).transpose(2, 3)}
    print("\ndecode layout sweep: layout block_n warps stages -> TB/s at (batch, context)", points)
    ta = triton_decode
    for name, cache in caches.items():
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    ta.DECODE_BLOCK_N, ta.DECODE_WARPS, ta.DECODE_STAGES = block_n, warps, stages
                    try:
                        tbps = [decode_point(cache, 16, b, c)[0] for b, c in points]
                    except OutOfResources as e:
                        print(name, block_n, warps, stages, type(e).__name__)
                        continue
                    print(name, block_n, warps, stages, " ".join(f"{t:6.2f}" for t in tbps))


def w1_decode_batches(steps) -> list[list[int]]:
    """Context lengths of W1's running sequences at decode step s (REFERENCE.md's W1: prompts
    and output lengths from random.seed(0)); a sequence runs while s < its output length."""
    rng = random.Random(0)
    prompts = []
    for _ in range(256):
        n = rng.randint(100, 1024)
        for _ in range(n):
            rng.randint(0, 10000)
        prompts.append(n)
    outputs = [rng.randint(100, 1024) for _ in range(256)]
    return [[p + s for p, o in zip(prompts, outputs) if o > s] for s in steps]


def ragged_sweep(device) -> None:
    """W1's decode batches (ragged contexts, Qwen3-0.6B heads, the graphs' full-width block
    tables) at forced KV split counts against the static rule, with the programs started in
    row order and longest context first; TB/s of the K/V moved."""
    kv_heads, head_dim, heads = 8, 128, 16
    steps = [50, 300, 500, 700, 850, 950, 1000]
    batches = w1_decode_batches(steps)
    width = 40960 // BLOCK
    cache = torch.randn(2, 256 * 2100 // BLOCK, BLOCK, kv_heads, head_dim, dtype=DTYPE,
                        device=device)
    options = [None, 1, 2, 4, 8, 16]
    print("\nW1 decode batches: step batch mean_ctx max_ctx order -> TB/s (us) at kv splits "
          "[rule] " + " ".join(map(str, options[1:])))
    for (step, ctx), ordered in itertools.product(zip(steps, batches), (False, True)):
        starts, seq_lens, tables = _metadata([1] * len(ctx), ctx, cache.shape[1], device)
        wide = torch.zeros(len(ctx), width, dtype=torch.int32, device=device)
        wide[:, :tables.shape[1]] = tables
        kv_bytes = 2 * sum(ctx) * kv_heads * head_dim * 2
        order = (torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
                 if ordered else None)
        cells = []
        for splits in options:
            calls = []
            for _ in range(4):
                query = torch.randn(len(ctx), heads, head_dim, dtype=DTYPE, device=device)
                calls.append(lambda q=query, n=splits: triton_attention.paged_attention(
                    q, cache, starts, seq_lens, wide, head_dim ** -0.5, decode_only=True,
                    num_kv_splits=n, decode_order=order))
            ms = graph_ms(calls)
            cells.append(f"{kv_bytes / ms / 1e9:5.2f} ({ms * 1e3:6.1f})")
        rule = triton_attention.num_decode_splits(len(ctx), kv_heads, width * BLOCK, device)
        print(f"{step:5d} {len(ctx):4d} {sum(ctx) // len(ctx):5d} {max(ctx):5d} "
              f"{'longest' if ordered else 'rows':>7}  [{rule:2d}] "
              + " ".join(cells))


def w1_prefill_lengths(tokens: int = 16384) -> list[int]:
    """W1's first prompts (REFERENCE.md: random.seed(0)), whole, up to one step's token budget:
    the prefill kernel's share of W1's first step."""
    rng, lengths = random.Random(0), []
    for _ in range(256):
        n = rng.randint(100, 1024)
        for _ in range(n):
            rng.randint(0, 10000)
        if sum(lengths) + n > tokens:
            break
        lengths.append(n)
    return lengths


def prefill_w1_sweep(device) -> None:
    """The prefill kernel on W1's first step (Qwen3-0.6B heads, 31 prompts, 15,705 tokens),
    cache slot-major and head-major, over launch configurations: TFLOP/s and µs per call."""
    heads, kv_heads, head_dim = LAYOUTS["qwen3-0.6b"]
    lengths = w1_prefill_lengths()
    blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    caches = {"slot-major": torch.randn(2, blocks, BLOCK, kv_heads, head_dim, dtype=DTYPE,
                                        device=device),
              "head-major": torch.randn(2, blocks, kv_heads, BLOCK, head_dim, dtype=DTYPE,
                                        device=device).transpose(2, 3)}
    starts, seq_lens, tables = _metadata(lengths, lengths, blocks, device)
    query = torch.randn(sum(lengths), heads, head_dim, dtype=DTYPE, device=device)
    flops = sum(4 * heads * head_dim * n * (n + 1) / 2 for n in lengths)
    print(f"\nW1 prefill step: {len(lengths)} prompts, {sum(lengths)} tokens; "
          "layout block_m block_n warps stages -> TFLOP/s (us)")
    ta = triton_attention
    for name, cache in caches.items():
        for block_m, block_n, warps, stages in itertools.product(
                (64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)):
            if name == "head-major" and (block_m, block_n, warps, stages) != (256, 64, 8, 3):
                continue   # the layout at today's configuration only
            ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N = block_m, block_n
            ta.PREFILL_WARPS, ta.PREFILL_STAGES = warps, stages
            try:
                ms = _time_ms(lambda c=cache: ta.paged_attention(
                    query, c, starts, seq_lens, tables, head_dim ** -0.5,
                    max_query_len=max(lengths)))
            except OutOfResources:
                continue
            print(name, block_m, block_n, warps, stages,
                  f"{flops / ms / 1e9:6.1f} ({ms * 1e3:7.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--sweep", action="store_true", help="time launch configurations instead")
    parser.add_argument("--ragged", action="store_true",
                        help="W1's ragged decode batches at forced KV split counts")
    parser.add_argument("--prefill-w1", action="store_true",
                        help="the prefill kernel on W1's first step, by launch configuration")
    parser.add_argument("--layout", action="store_true",
                        help="W1's decode shapes: cache layouts x launch configurations")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(device), "torch", torch.__version__,
          "triton", triton.__version__)
    check(device)
    if args.ragged:
        ragged_sweep(device)
    elif args.prefill_w1:
        prefill_w1_sweep(device)
    elif args.layout:
        layout_sweep(device)
    elif args.sweep:
        sweep(device)
    elif args.quick:
        bench_decode([1, 64, 256], [1024, 8192], device)
        bench_prefill([2048, 8192], 16384, device)
    else:
        bench_decode([1, 8, 32, 64, 128, 256], [1024, 4096, 8192, 32768], device)
        bench_prefill([1024, 2048, 4096, 8192, 16384], 16384, device)


if __name__ == "__main__":
    main()
