"""Triton paged attention of a whole mixed batch in one launch whose grid depends only on the
token count: the attention of a full CUDA graph of a prefill or mixed step
(``headrace.dataplane.full_graphs``).

Why: the decode and prefill kernels of ``headrace.kernels.triton_attention`` size their grids from
the step (the number of decodes, the longest query, the split count), so a graph of them would be
valid for one step shape only, and the piecewise graphs launch them eagerly between pieces: ~60-90
launches of ~10-20 µs of host time each per step (plus the graph replays), which left the H200
waiting on the host in mixed steps (``bench/step_host.py``: 7 ms of host for 7.5 ms of device). Here
the grid is (query blocks of the padded token range, KV heads), and the step's metadata (query
offsets, context lengths, block tables) is read from device buffers, so the launch captures once per
token-count bucket and a replay serves any batch of that size.

Layout (as vLLM's ``triton_unified_attention``, written for our cache and inner loop): a
sequence of q_len queries owns the query blocks ``[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q
+ i + 1)`` (at least ceil(q_len / BLOCK_Q) of them; the extra one, if any, exits at once).
Program b finds its sequence by a binary search over ``query_start_loc`` for the last i whose
first block is <= b, and its tile within it; a tile past the sequence's queries returns. So
``tokens // BLOCK_Q + min(seqs, tokens)`` programs cover every query of any batch of ``tokens``
tokens. A graph's buffers hold a fixed number of sequences: the unused ones are padding with
q_len 0 (``query_start_loc`` continues at the real token count), after every real one; tokens
past the last real sequence belong to none and their output rows are not written.

Each program holds BLOCK_Q query tokens x the GQA group (padded to a power of two) as the rows of
one tile, so a K/V tile is loaded once per group, and runs ``headrace.kernels.triton_flash._attend``
over the keys visible to the tile: unmasked below its first query, masked on the causal diagonal; a
decode row is a tile of one query over its whole context (a split-KV kernel would spread a long
decode over more SMs; the decode-only steps keep ``headrace.kernels.triton_decode`` in their own
graphs). Programs start last-first: the prefill chunks, which come after the decodes and hold the
long causal tiles, start before the one-token decode tiles fill in behind them. An FP8 cache is read
as such (``Launch``: k_scale in the score scale, v_scale on the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import next_pow2
from headrace.kernels.triton_flash import Launch, _causal_tile

# Rows (query tokens x padded group) per tile. 64 is a start value between vLLM's 16 (decode
# rows waste little) and our prefill kernel's 256 (keys reloaded less often): bench/
# unified_attention.py sweeps it on the GPU, and the measured best goes here.
BLOCK_M = 64
BLOCK_N, STAGES = 64, 3


@triton.jit
def _find_seq(QSL, block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i < num_seqs whose first query block qsl[i] // BLOCK_Q + i <= block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QSL + mid) // BLOCK_Q + mid <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs and the block-table stride vary between eager calls: no specialisation on them.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _unified_kernel(Q, K, V, OUT, QSL, SEQ_LENS, BT, num_seqs, qk_scale, v_scale, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                    stride_head, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, KV_F16: tl.constexpr,
                    V_T: tl.constexpr):
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(QSL, block, num_seqs, BLOCK_Q)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    tile = block - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    _causal_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, tl.load(SEQ_LENS + seq),
                 qk_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                 stride_block, stride_slot, stride_head, G, G_PAD, BLOCK_Q, HEAD_DIM, BLOCK_N,
                 BLOCK_SIZE, PRECISION, DOT_F32, KV_F16, V_T)


def tile_rows(tokens: int, group: int, wide: bool, block_m: int | None = None) -> int:
    """Rows of a tile: ``block_m`` (default BLOCK_M), at most 64 for float32 (shared memory),
    no more than the padded token range needs, at least 16 (tl.dot)."""
    g_pad = next_pow2(group)
    rows = min(block_m or BLOCK_M, 64 if wide else 256)
    return max(16, g_pad, min(rows, next_pow2(max(tokens, 1)) * g_pad))


def num_programs(tokens: int, seqs: int, block_q: int) -> int:
    """Query blocks that cover every query of ``seqs`` sequences of ``tokens`` tokens in all."""
    return tokens // block_q + min(seqs, tokens)


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                      k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                      block_m: int | None = None) -> torch.Tensor:
    """headrace.kernels.reference.paged_attention's semantics in one launch sized by ``query``'s
    token count and ``seq_lens``' length only (no host sync, nothing read from the device on the
    host). Sequences past the real ones may be padding with q_len 0 (``query_start_loc`` continuing
    at the last real offset); query rows past ``query_start_loc[-1]`` are left as they are in
    ``out``. ``block_m``: rows per tile (the bench's sweep)."""
    tokens, heads, head_dim = query.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tokens == 0:
        return out
    launch = Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    keys, values = kv_cache[0], kv_cache[1]
    kv_heads, block_size = keys.shape[2], keys.shape[1]
    group = heads // kv_heads
    g_pad = next_pow2(group)
    wide = query.element_size() > 2
    rows = tile_rows(tokens, group, wide, block_m)
    block_q = rows // g_pad
    seqs = seq_lens.shape[0]
    _unified_kernel[(num_programs(tokens, seqs, block_q), kv_heads)](
        query, keys, values, out, query_start_loc, seq_lens, block_tables, seqs,
        launch.qk_scale, launch.v_scale, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), *launch.cache_strides, G=group, G_PAD=g_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, PRECISION=launch.precision,
        DOT_F32=launch.dot_f32, KV_F16=launch.kv_f16, V_T=launch.v_t,
        num_warps=8 if rows >= 128 else 4,
        num_stages=2 if wide else STAGES)
    return out
