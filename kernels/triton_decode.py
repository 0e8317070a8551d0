"""Triton decode attention: one query token per sequence, over the paged KV cache.

Why a kernel of its own: a decode step reads every key and value of every sequence once and
does two small products with each, so it is bound by memory bandwidth, not by the tensor cores,
and one program per (sequence, KV head) leaves most SMs idle at small batches or long contexts.
So the grid is (kv head x kv split, sequence); one program handles all query heads of its KV
head (the GQA group, padded to >= 16 rows for tl.dot) over one contiguous share of the context
(flash-decoding). The number of splits is a power of two chosen from static shapes only (batch,
kv heads, block-table width), so the launch needs no host sync and can be captured in a CUDA
graph; ``_combine_kernel`` then merges the splits' partial outputs by their log-sum-exp. An
optional order (the host sorts the batch by context, longest first) starts the long sequences'
programs first, so ragged batches do not end on a wave of one long sequence.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from headrace.kernels.host import next_pow2
from headrace.kernels.triton_flash import Launch, _attend, _query_operand

# Launch configuration (BLOCK_N: keys per loop iteration, warps, stages), tuned on an H200
# (triton 3.6; bench/fp8_kv_attention.py --tiles / --bf16-tiles). The K/V addresses come from a
# block-table load in the same iteration, and Triton's pipeliner splits num_stages along that
# chain: 3-4 stages give one K/V buffer (the next tile's copy is issued after this one is
# consumed), 5-6 give two. The warps of a program split a tile's keys, so the softmax's row max
# and sum cross warps through shared memory: 9 barriers a loop step with 2 or 4 warps, 2 with
# one (the SASS: bench/decode_ptx.py compiles the kernel on any machine).
# bf16: 64 keys on 4 warps reach 3.8-4.5 TB/s at batch >= 64. 32/2/5 was as fast (it looked 5%
# faster until timed first in a row: a row's first timing ran ~5% slow); 64/2/5 and 64/4/5 were
# up to 1.3x slower at batch 64 (2026-12-03).
DECODE_TILE = (64, 4, 3)
# Over an FP8 cache (V stored transposed within each block, ``headrace.kernels.kv_layout``), in one split
# (the batch alone gives every SM two programs, ``num_decode_splits``: long contexts a program):
# 64 keys on one warp, 0.93-0.95x of 64/2/4's time at batch 256 (3.1-3.3 TB/s of FP8 bytes),
# even with it at batch 64; two buffers and 32- or 128-key tiles no faster. In several splits
# (small batches: short chunks a program) one warp measured up to 1.2x slower at batch 1-32,
# so those keep the tile before: 64 keys on 2 warps.
FP8_DECODE_TILE, FP8_SPLIT_DECODE_TILE = (64, 1, 4), (64, 2, 4)
MIN_SPLIT_TOKENS = 256     # a decode split gets at least this much of the longest context
MAX_SPLITS = 32


# Block-table widths vary from step to step in eager (mixed) steps: no specialisation on them,
# or every new width divisibility would compile a variant in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q, K, V, SEQ_LENS, BT, ORDER, PART_O, PART_LSE, OUT, qk_scale, v_scale, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                   stride_head, NUM_SPLITS: tl.constexpr,
                   G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_F32: tl.constexpr, HAS_ORDER: tl.constexpr, KV_F16: tl.constexpr,
                   V_T: tl.constexpr):
    # Programs start in grid order, all of one sequence's (kv head, split) programs together;
    # with ORDER (sequences by context, longest first) the long ones start first and the short
    # ones fill in behind them: the last wave is short.
    seq = tl.program_id(1)
    if HAS_ORDER:
        seq = tl.load(ORDER + seq)
    kv_head, split = tl.program_id(0) // NUM_SPLITS, tl.program_id(0) % NUM_SPLITS
    ctx = tl.load(SEQ_LENS + seq)
    rows = tl.arange(0, G_PAD)
    heads = kv_head * G + rows
    d = tl.arange(0, HEAD_DIM)
    q = _query_operand(tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                               mask=(rows < G)[:, None], other=0.0), KV_F16, DOT_F32)
    chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    q_pos = tl.full([G_PAD], ctx - 1, tl.int32)  # the one query sees every key below ctx
    bt_row = BT + seq * stride_bt
    if V_T:   # whole tiles unmasked (the one query sees every key below ctx), then the partial one,
        # its keys masked in the scores and its V read in whole blocks (headrace.kernels.kv_layout)
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head * stride_head, lo, full, q_pos,
                                qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                                False, PRECISION, DOT_F32 and not KV_F16, q.dtype, V_T)
        lo = full
    # (a bf16 cache: one masked loop; split as above, it measured up to 1.2x slower at batch 64)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head * stride_head, lo, hi, q_pos,
                            qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                            True, PRECISION, DOT_F32 and not KV_F16, q.dtype, V_T)
    acc = acc * v_scale
    if NUM_SPLITS == 1:   # the whole context in one program: the output itself, no combine
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=(rows < G)[:, None])
        return
    # An empty split (lo >= hi) stores output 0 with lse -inf: it weighs nothing in the combine.
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (seq * (tl.num_programs(0) // NUM_SPLITS) * G + heads) * NUM_SPLITS + split
    tl.store(PART_LSE + part, lse, mask=rows < G)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(PART_O + part[:, None] * HEAD_DIM + d[None, :], out, mask=(rows < G)[:, None])


@triton.jit
def _combine_kernel(PART_O, PART_LSE, OUT, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PART_LSE + base + splits)
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all -inf: empty context, output 0
    o = tl.load(PART_O + (base + splits[:, None]) * HEAD_DIM + d[None, :])
    den = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + seq * stride_ot + head * stride_oh + d, out.to(OUT.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Fewest KV splits among 1, 4, 16, MAX_SPLITS that give every SM two programs, while each
    split keeps at least MIN_SPLIT_TOKENS of the longest possible context. Depends on shapes
    only. Two splits are skipped: on W1's ragged batches of 23 and 48 sequences (H200) they
    were up to 29% slower than one or four (bench/kernels.py --ragged)."""
    splits, target = 1, 2 * _sm_count(device)
    while splits < MAX_SPLITS and batch * kv_heads * splits < target:
        more = min(MAX_SPLITS, 4 * splits)
        if max_context < more * MIN_SPLIT_TOKENS:
            break
        splits = more
    return splits


def decode_config(fp8: bool, splits: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the decode kernel over a bf16/fp16/fp32 or an FP8 cache, in
    ``splits`` KV splits a sequence."""
    if not fp8:
        return DECODE_TILE
    return FP8_DECODE_TILE if splits == 1 else FP8_SPLIT_DECODE_TILE


def decode(launch: Launch, seq_lens: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor,
           num_kv_splits: int | None, order: torch.Tensor | None,
           config: tuple[int, int, int] | None = None) -> None:
    """Launches decode attention for these sequences (one query token each) into ``out``;
    ``config``: (BLOCK_N, warps, stages) instead of ``decode_config``'s (the bench's sweep)."""
    query, (keys, values) = launch.query, (launch.kv_cache[0], launch.kv_cache[1])
    batch, (_, heads, head_dim) = seq_lens.shape[0], query.shape
    kv_heads, block_size = keys.shape[2], keys.shape[1]
    splits = num_kv_splits or num_decode_splits(
        batch, kv_heads, block_tables.shape[1] * block_size, query.device)
    if splits == 1:    # the kernel writes ``out`` itself
        part_o = part_lse = out
    else:
        part_o = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32,
                             device=query.device)
        part_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=query.device)
    group = heads // kv_heads
    block_n, warps, stages = config or decode_config(launch.fp8, splits)
    _decode_kernel[(kv_heads * splits, batch)](
        query, keys, values, seq_lens, block_tables, seq_lens if order is None else order,
        part_o, part_lse, out, launch.qk_scale, launch.v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *launch.cache_strides,
        NUM_SPLITS=splits, G=group,
        G_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, PRECISION=launch.precision,
        DOT_F32=launch.dot_f32, HAS_ORDER=order is not None, KV_F16=launch.kv_f16,
        V_T=launch.v_t,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _combine_kernel[(batch, heads)](part_o, part_lse, out, out.stride(0), out.stride(1),
                                        NUM_SPLITS=splits, HEAD_DIM=head_dim, num_warps=4)
