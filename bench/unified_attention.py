"""Device time of the unified attention kernel (``headrace.kernels.triton_unified``: the full CUDA
graphs' one launch per layer) against the split launches the piecewise and eager steps make (the
split-KV decode kernel for the decodes + the prefill kernel for the chunks,
``headrace.kernels.triton_attention.paged_attention``), per tile size, on Qwen3-0.6B's attention
layout (16 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16 in shuffled order).

Why: the unified kernel gives each decode row a tile of its own over its whole context (no KV
split) and tiles prefill chunks at one size for every batch, so it may cost device time where
the split kernels were tuned; this says how much, per layer, for the step shapes of
``bench/step_host.py`` (decode / mixed / prefill), and which ``BLOCK_M`` to make the default.
Each call is replayed from a CUDA graph (no launch overhead), the unified one over its padded
bucket as the graphs run it. Not a test: ``python -m bench.unified_attention`` on the GPU; one
JSON line per (shape, kernel) and a table.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernels import BLOCK, DTYPE, _metadata, graph_ms
from headrace.dataplane.mixed_graphs import token_buckets
from headrace.kernels import reference, triton_attention, triton_unified

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def shapes(seqs: int, prefill: int, prefill_only: int) -> dict[str, tuple[list[int], list[int]]]:
    """(q_lens, ctx_lens) per step kind: decodes over 128-384 cached tokens first."""
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(128, 385, (seqs,), generator=g).tolist()
    return {"decode": ([1] * seqs, ctx),
            "mixed": ([1] * seqs + [prefill], ctx + [prefill]),
            "prefill": ([prefill_only // 4] * 4, [prefill_only // 4] * 4),
            "chunk_8k": ([2048], [8192])}


def bench_shape(name: str, q_lens: list[int], ctx_lens: list[int], block_ms: list[int],
                device) -> list[dict]:
    tokens = sum(q_lens)
    bucket = next((b for b in token_buckets(4096) if b >= tokens), tokens)
    num_blocks = sum(-(-c // BLOCK) for c in ctx_lens) + 16
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(DTYPE)
    starts, lens, tables = _metadata(q_lens, ctx_lens, num_blocks, device)
    query = torch.randn(bucket, HEADS, HEAD_DIM, device=device).to(DTYPE)
    scale = HEAD_DIM ** -0.5
    decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    hints = (dict(decode_only=True) if decodes == len(q_lens)
             else dict(max_query_len=max(q_lens), num_decodes=decodes))
    real = query[:tokens]
    split_out = torch.empty_like(real)
    rows = []

    def split():
        triton_attention.paged_attention(real, cache, starts, lens, tables, scale, out=split_out, **hints)

    ms = graph_ms([split])
    rows.append(dict(shape=name, tokens=tokens, kernel="split", block_m=None, us=round(ms * 1e3, 1)))
    # the graphs' padded metadata: as many sequences as the step has, plus padding to max_seqs
    pad = max(0, 264 - len(q_lens))
    p_starts = torch.cat([starts, starts[-1:].repeat(pad)])
    p_lens = torch.cat([lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    p_tables = torch.cat([tables, torch.zeros((pad, tables.shape[1]), dtype=torch.int32, device=device)])
    expect = split_out.float()
    for block_m in block_ms:
        out = torch.zeros_like(query)

        def unified(block_m=block_m, out=out):
            triton_unified.unified_attention(query, cache, p_starts, p_lens, p_tables, scale,
                                             out=out, block_m=block_m)

        ms = graph_ms([unified])
        err = (out[:tokens].float() - expect).abs().max().item()
        rows.append(dict(shape=name, tokens=tokens, bucket=bucket, kernel="unified", block_m=block_m,
                         us=round(ms * 1e3, 1), max_abs_diff_vs_split=round(err, 4)))
    return rows


def check(device) -> None:
    """The unified kernel against the reference on one small ragged batch before timing."""
    q_lens, ctx_lens = [1, 1, 40, 7], [300, 17, 90, 7]
    num_blocks = sum(-(-c // BLOCK) for c in ctx_lens) + 4
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(DTYPE)
    starts, lens, tables = _metadata(q_lens, ctx_lens, num_blocks, device)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=device).to(DTYPE)
    expect = reference.paged_attention(query, cache, starts, lens, tables, HEAD_DIM ** -0.5)
    got = triton_unified.unified_attention(query, cache, starts, lens, tables, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got.float(), expect.float(), atol=2e-2, rtol=2e-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prefill-only", type=int, default=2048)
    ap.add_argument("--block-m", default="16,32,64,128")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    check(device)
    block_ms = [int(b) for b in args.block_m.split(",")]
    rows = []
    for name, (q_lens, ctx_lens) in shapes(args.seqs, args.prefill, args.prefill_only).items():
        for row in bench_shape(name, q_lens, ctx_lens, block_ms, device):
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'shape':<10}{'tokens':>7}" + "".join(f"{'BLOCK_M ' + str(b):>13}" for b in block_ms)
          + f"{'split':>9}   (µs per layer, from a CUDA graph)")
    for name in dict.fromkeys(r["shape"] for r in rows):
        by = {r["block_m"]: r for r in rows if r["shape"] == name}
        print(f"{name:<10}{by[None]['tokens']:>7}" + "".join(f"{by[b]['us']:>13.1f}" for b in block_ms)
              + f"{by[None]['us']:>9.1f}")


if __name__ == "__main__":
    main()
