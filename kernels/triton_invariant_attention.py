"""Batch-invariant Triton paged attention for ``--deterministic``: a query row's output bits are
a function of its query, its position and its sequence's cached keys and values only, the
same whether the row is a decode (one query, alone or among 255 others), one row of a prefill
chunk of any size, or a verified draft; over a prefix read from the cache or computed.

Why the default kernels are not: the decode kernel splits a context into a number of shares
chosen from the batch size (``triton_decode.num_decode_splits``) and merges them by their
log-sum-exp, while the prefill and unified kernels walk all keys in one online softmax with a
tile height that grows with the longest query; so a token's attention output, and the KV that
later layers compute from it, changes with the batch and with the step that computed it
(which a preemption by recompute, a host-tier recompute or a chunking change moves).

Every launch here computes ``headrace.kernels.triton_invariant_tile``'s canonical order for every row
(fixed key splits from position 0, each an online softmax over fixed key tiles, folded in
order), on one tile shape, with FMA contraction off.

Launches: prefill and mixed steps' prefill rows (``prefill``, grid as
``triton_attention``'s) and the full graphs' one launch (``unified``, grid as
``triton_unified``'s) walk every split of a tile in one program, folding as they go (a second
float32 accumulator). Decode rows go to ``headrace.kernels.triton_invariant_decode`` (a long context's
splits spread over programs, their partials folded by a combine kernel).

What it gives up against the default kernels: the tile is not sized per step (64 rows, not up
to 256: a long prefill reloads K/V more often), decodes run the tensor cores on a 64-row tile
of which one token's heads are real, a long decode is split into fixed 512-token shares rather
than as many as the SMs want, and a decode of a context past one split pays the combine. What
it keeps: the paged cache as is (block tables, FP8 KV with its scales), CUDA graphs (no host
sync; the decode's split count comes from the block-table width), and no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv
from headrace.kernels.triton_flash import Launch
from headrace.kernels.triton_invariant_decode import decode
from headrace.kernels import triton_invariant_tile as tile
from headrace.kernels.triton_invariant_tile import _det_tile
from headrace.kernels.triton_unified import _find_seq, num_programs


@triton.jit(do_not_specialize=["seq0", "stride_bt"])
def _prefill_kernel(Q, K, V, OUT, QSL, SEQ_LENS, BT, seq0, qk_scale, v_scale, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                    stride_head, SPLIT_TOKENS: tl.constexpr, G: tl.constexpr,
                    G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_F32: tl.constexpr, KV_F16: tl.constexpr, V_T: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)   # the causal tail's long tiles first
    kv_head, seq = tl.program_id(1), seq0 + tl.program_id(2)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    _det_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, tl.load(SEQ_LENS + seq),
              qk_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
              stride_block, stride_slot, stride_head, SPLIT_TOKENS, G, G_PAD, BLOCK_Q, HEAD_DIM,
              BLOCK_N, BLOCK_SIZE, PRECISION, DOT_F32, KV_F16, V_T)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _unified_kernel(Q, K, V, OUT, QSL, SEQ_LENS, BT, num_seqs, qk_scale, v_scale, stride_qt,
                    stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                    stride_head, SPLIT_TOKENS: tl.constexpr, G: tl.constexpr,
                    G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_F32: tl.constexpr, KV_F16: tl.constexpr, V_T: tl.constexpr):
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(QSL, block, num_seqs, BLOCK_Q)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    tile = block - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    _det_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, tl.load(SEQ_LENS + seq),
              qk_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
              stride_block, stride_slot, stride_head, SPLIT_TOKENS, G, G_PAD, BLOCK_Q, HEAD_DIM,
              BLOCK_N, BLOCK_SIZE, PRECISION, DOT_F32, KV_F16, V_T)


# the split count and the table width vary between eager steps: no variant compiled per value
def prefill(launch: Launch, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, out: torch.Tensor, seq0: int, max_query_len: int) -> None:
    """Sequences seq0.. of the call (their rows at query_start_loc's offsets)."""
    query, kv = launch.query, launch.kv_cache
    shape = tile.layout(query, kv)
    grid = (cdiv(max_query_len, shape["BLOCK_Q"]), kv.shape[3], seq_lens.shape[0] - seq0)
    _prefill_kernel[grid](query, kv[0], kv[1], out, query_start_loc, seq_lens, block_tables, seq0,
                          launch.qk_scale, launch.v_scale, query.stride(0), query.stride(1),
                          out.stride(0), out.stride(1), *launch.cache_strides, **shape,
                          **tile.common(launch), **tile.launch_options(query))


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())   # syncs with the device


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, decode_only: bool | None = None,
                    num_decodes: int = 0, decode_order: torch.Tensor | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``headrace.kernels.triton_attention.paged_attention``'s interface and hints (``decode_order`` is
    not needed); every row batch-invariant (module docstring)."""
    tokens, batch = query.shape[0], seq_lens.shape[0]
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tokens == 0:
        return out
    if not decode_only:
        max_query_len = max_query_len or _max_query_len(query_start_loc)
        decode_only = tokens == batch and max_query_len == 1
    launch = Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    if decode_only:
        decode(launch, seq_lens, block_tables, out)
        return out
    if num_decodes:
        decode(Launch(query[:num_decodes], kv_cache, block_tables, scale, k_scale, v_scale),
               seq_lens[:num_decodes], block_tables[:num_decodes], out[:num_decodes])
    prefill(launch, query_start_loc, seq_lens, block_tables, out, num_decodes, max_query_len)
    return out


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``headrace.kernels.triton_unified.unified_attention``'s interface (padded sequences of q_len 0,
    rows past the last real token left as they are), every row batch-invariant."""
    tokens = query.shape[0]
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tokens == 0:
        return out
    launch = Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    shape = tile.layout(query, kv_cache)
    seqs = seq_lens.shape[0]
    grid = (num_programs(tokens, seqs, shape["BLOCK_Q"]), kv_cache.shape[3])
    _unified_kernel[grid](query, kv_cache[0], kv_cache[1], out, query_start_loc, seq_lens,
                          block_tables, seqs, launch.qk_scale, launch.v_scale, query.stride(0),
                          query.stride(1), out.stride(0), out.stride(1), *launch.cache_strides,
                          **shape, **tile.common(launch), **tile.launch_options(query))
    return out
