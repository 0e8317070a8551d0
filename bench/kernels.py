"""Benchmark of the engine's Triton paged attention kernels on a CUDA GPU (written for the H200).

Prints achieved TB/s of paged decode attention (bytes = all K/V of the batch + q + out) and TFLOP/s
of causal prefill attention (4 * H * D * causal score count) against torch's SDPA, after checking
both kernels against ``headrace.kernels.reference`` on small ragged cases. bf16, block size 16, KV
blocks in shuffled order; decode is timed from CUDA graphs, as the engine runs it. Not a test:
``python -m bench.kernels [--quick | --ragged]`` on the GPU; --ragged replays W1's own decode
batches at forced KV split counts, programs in row order and longest context first.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from bench.serving_bench import w1_requests
from headrace.kernels import reference, triton_attention

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


def graph_ms(calls, replays: int = 10) -> float:
    """Milliseconds per call when the calls replay from one CUDA graph (no launch overhead);
    when their inputs differ (distinct batches), the L2 cache cannot serve repeats."""
    for call in calls:
        call()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / len(calls)


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


def w1_decode_batches(steps) -> list[list[int]]:
    """Context lengths of W1's running sequences at decode step s (a sequence runs while s is
    below its output length)."""
    requests = w1_requests()
    return [[len(p) + s for p, out, _ in requests if out > s] for s in steps]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--ragged", action="store_true",
                        help="W1's ragged decode batches at forced KV split counts")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(device), "torch", torch.__version__,
          "triton", triton.__version__)
    check(device)
    if args.ragged:
        ragged_sweep(device)
    elif args.quick:
        bench_decode([1, 64, 256], [1024, 8192], device)
        bench_prefill([2048, 8192], 16384, device)
    else:
        bench_decode([1, 8, 32, 64, 128, 256], [1024, 4096, 8192, 32768], device)
        bench_prefill([1024, 2048, 4096, 8192, 16384], 16384, device)


if __name__ == "__main__":
    main()
