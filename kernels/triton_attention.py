"""Triton paged attention over the ``[2, blocks, block_size, kv_heads, head_dim]`` KV cache.

``paged_attention`` is the entry point: it sends one-token sequences to the decode kernel
(``headrace.kernels.triton_decode``: memory-bound, the context split over SMs) and the rest to the
prefill kernel here. Both share one inner loop (``headrace.kernels.triton_flash._attend``).

Prefill and mixed batches are compute-bound (many query tokens share each key), so their
kernel tiles queries for the tensor cores: grid (query tile, kv head, sequence); a tile's rows
are BLOCK_Q query tokens x the GQA group, so each K/V tile is loaded once per group. Sequence
i's queries are the last q_len_i of its seq_lens[i] positions and attend causally to the cache,
whose K/V for the new tokens are already written. Key tiles wholly below the tile's first query
skip all masking; tiles run longest-first.

Keys at or past a sequence's length are never loaded (masked loads, other=0) and get -inf scores,
so unwritten slots, which may hold NaN, cannot leak in. head_dim must be a power of two >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels import triton_decode
from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.triton_decode import num_decode_splits  # noqa: F401  (part of this module's API)
from headrace.kernels.triton_flash import Launch, _causal_tile

# Launch configuration, tuned on an H200 (triton 3.6) with ``bench/kernels.py --sweep``: causal
# bf16 prefill reaches 300-450 TFLOP/s (hd 128, GQA 4). Decode's is in ``headrace.kernels.triton_decode``.
PREFILL_BLOCK_M = 256                                      # rows (query tokens x group) per tile
PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 64, 8, 3


@triton.jit(do_not_specialize=["seq0", "stride_bt"])   # both vary per step: one variant
def _prefill_kernel(Q, K, V, OUT, QSL, SEQ_LENS, BT, seq0, qk_scale, v_scale, stride_qt, stride_qh, stride_ot,
                    stride_oh, stride_bt, stride_block, stride_slot, stride_head,
                    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, KV_F16: tl.constexpr,
                    V_T: tl.constexpr):
    # Tiles run last-first: the causal tail's longest tiles start early, the short ones fill in.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head, seq = tl.program_id(1), seq0 + tl.program_id(2)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    _causal_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, tl.load(SEQ_LENS + seq),
                 qk_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                 stride_block, stride_slot, stride_head, G, G_PAD, BLOCK_Q, HEAD_DIM, BLOCK_N,
                 BLOCK_SIZE, PRECISION, DOT_F32, KV_F16, V_T)


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())  # syncs with the device


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, decode_only: bool | None = None,
                    num_kv_splits: int | None = None, num_decodes: int = 0,
                    decode_order: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of variable-length queries over paged KV; see
    headrace.kernels.reference.paged_attention. Host-side hints avoid a device sync:
    ``decode_only=True`` promises every sequence has exactly one query token; otherwise
    ``max_query_len`` (the longest q_len) is needed, and found with one sync when not given. All
    q_len == 1 takes the decode kernel either way. ``num_kv_splits`` (a power of two) overrides
    num_decode_splits. ``num_decodes``: the first that many sequences of a mixed batch have one
    query token each; they take the decode kernel (a prefill tile would pad each of them to BLOCK_Q
    tokens). ``decode_order`` (int32, a permutation of the decode rows, longest context first) is
    the order their programs start in: a scheduling hint that leaves the result unchanged. ``out``:
    a contiguous tensor of the query's shape to write (default: a new one)."""
    tokens, heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tokens == 0:
        return out
    if not decode_only:
        max_query_len = max_query_len or _max_query_len(query_start_loc)
        decode_only = tokens == batch and max_query_len == 1
    launch = Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    if decode_only:
        triton_decode.decode(launch, seq_lens, block_tables, out, num_kv_splits, decode_order)
        return out
    if num_decodes:   # the decodes' rows are the first num_decodes of query, seq_lens, tables
        triton_decode.decode(launch, seq_lens[:num_decodes], block_tables[:num_decodes],
                             out[:num_decodes], num_kv_splits, decode_order)
    prefill(launch, query_start_loc, seq_lens, block_tables, out, num_decodes, max_query_len)
    return out


def prefill(launch: Launch, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, out: torch.Tensor, seq0: int, max_query_len: int) -> None:
    """Sequences seq0.. (the rows' offsets in query stay absolute: query_start_loc's)."""
    query, (keys, values) = launch.query, (launch.kv_cache[0], launch.kv_cache[1])
    _, heads, head_dim = query.shape
    kv_heads, block_size = keys.shape[2], keys.shape[1]
    group = heads // kv_heads
    g_pad = next_pow2(group)
    wide = query.element_size() > 2  # float32: a quarter of the tile and fewer stages fit smem
    block_m = min(PREFILL_BLOCK_M // (4 if wide else 1),
                  max(16, next_pow2(max_query_len) * g_pad))
    block_q = block_m // g_pad
    grid = (cdiv(max_query_len, block_q), kv_heads, seq_lens.shape[0] - seq0)
    _prefill_kernel[grid](
        query, keys, values, out, query_start_loc, seq_lens, block_tables,
        seq0, launch.qk_scale, launch.v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *launch.cache_strides, G=group, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_N=PREFILL_BLOCK_N, BLOCK_SIZE=block_size, PRECISION=launch.precision,
        DOT_F32=launch.dot_f32, KV_F16=launch.kv_f16, V_T=launch.v_t,
        num_warps=PREFILL_WARPS if block_m >= 128 else 4,
        num_stages=2 if wide else PREFILL_STAGES)
