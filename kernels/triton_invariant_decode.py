"""The decode launch of ``--deterministic``'s attention: one query a sequence, its context's
splits (``headrace.kernels.triton_invariant_tile``'s canonical order) dealt to programs so that a long
context is spread over the SMs at any batch size, each split's float32 partial (m, l, a) to a
workspace, and a combine kernel folding them in split order: the bits of the same row in a
prefill tile, which folds in registers. A context of one split (<= SPLIT_TOKENS) is finished by
its one program, without the workspace.

In CUDA graphs the grid is sized by the block table's width (the decode graphs' is the whole
``max_model_len``): programs whose share holds no split of their sequence exit at once, and the
workspace (batch x width / SPLIT_TOKENS x heads x head_dim floats) comes from the graph's pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.skinny_gemm import sm_count
from headrace.kernels.triton_flash import Launch
from headrace.kernels import triton_invariant_tile as tile
from headrace.kernels.triton_invariant_tile import _fold, _split, _tile_rows

@triton.jit(do_not_specialize=["stride_bt", "MAX_SPLITS", "NUM_HEADS"])
def _decode_kernel(Q, K, V, OUT, SEQ_LENS, BT, PART_O, PART_ML, qk_scale, v_scale, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                   stride_head, MAX_SPLITS, NUM_HEADS, SPLIT_TOKENS: tl.constexpr,
                   SHARES: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                   BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                   KV_F16: tl.constexpr, V_T: tl.constexpr):
    """Program (KV head x share, sequence): splits share, share + SHARES, ... of the one
    query of the sequence (row ``seq`` of Q), as the first token of a prefill tile: each
    split's partial to PART_O / PART_ML, or, for a context of one split, the output itself."""
    ROWS: tl.constexpr = BLOCK_Q * G_PAD
    kv_head, share = tl.program_id(0) // SHARES, tl.program_id(0) % SHARES
    seq = tl.program_id(1)
    ctx = tl.load(SEQ_LENS + seq)
    n_splits = tl.cdiv(ctx, SPLIT_TOKENS)
    if share >= n_splits:
        return
    tok, heads, row_ok, q, q_pos = _tile_rows(Q, seq, 0, kv_head, seq, 1, ctx, stride_qt,
                                              stride_qh, G, G_PAD, BLOCK_Q, HEAD_DIM, KV_F16,
                                              DOT_F32)
    below = ctx // BLOCK_N * BLOCK_N            # the prefill tile's rule, with q_len = 1
    bt_row = BT + seq * stride_bt
    d = tl.arange(0, HEAD_DIM)
    for j in range(share, n_splits, SHARES):
        lo = j * SPLIT_TOKENS
        m, l, a = _split(q, K, V, bt_row, kv_head * stride_head, lo,
                         tl.minimum(ctx, lo + SPLIT_TOKENS), below, q_pos, qk_scale,
                         stride_block, stride_slot, ROWS, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PRECISION,
                         DOT_F32 and not KV_F16, V_T)
        if n_splits == 1:    # the whole context here: fold from the start and finish
            M = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            L = tl.zeros([ROWS], dtype=tl.float32)
            A = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
            M, L, A = _fold(M, L, A, m, l, a)
            out = A * v_scale / tl.where(row_ok & (L > 0), L, 1.0)[:, None]
            tl.store(OUT + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            item = (seq * MAX_SPLITS + j).to(tl.int64) * NUM_HEADS + heads
            tl.store(PART_O + item[:, None] * HEAD_DIM + d[None, :], a, mask=row_ok[:, None])
            tl.store(PART_ML + item * 2, m, mask=row_ok)
            tl.store(PART_ML + item * 2 + 1, l, mask=row_ok)


@triton.jit(do_not_specialize=["MAX_SPLITS", "NUM_HEADS"])
def _combine_kernel(SEQ_LENS, PART_O, PART_ML, OUT, v_scale, stride_ot, stride_oh, MAX_SPLITS,
                    NUM_HEADS, SPLIT_TOKENS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """Program (sequence, KV head): folds its splits' partials in order (n > 1 only)."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    n_splits = tl.cdiv(tl.load(SEQ_LENS + seq), SPLIT_TOKENS)
    if n_splits <= 1:
        return
    rows = tl.arange(0, G_PAD)
    real = rows < G
    heads = kv_head * G + rows
    d = tl.arange(0, HEAD_DIM)
    M = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    L = tl.zeros([G_PAD], dtype=tl.float32)
    A = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    for j in range(0, n_splits):
        item = (seq * MAX_SPLITS + j).to(tl.int64) * NUM_HEADS + heads
        m = tl.load(PART_ML + item * 2, mask=real, other=float("-inf"))
        l = tl.load(PART_ML + item * 2 + 1, mask=real, other=0.0)
        a = tl.load(PART_O + item[:, None] * HEAD_DIM + d[None, :], mask=real[:, None], other=0.0)
        M, L, A = _fold(M, L, A, m, l, a)
    out = A * v_scale / tl.where(real & (L > 0), L, 1.0)[:, None]
    tl.store(OUT + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=real[:, None])


def shares_for(batch: int, kv_heads: int, max_splits: int, device: torch.device) -> int:
    """Programs a sequence's splits are dealt to: a power of two up to its split count, enough
    for two programs an SM (scheduling only: the same bits for any count)."""
    shares = 1
    while shares < max_splits and batch * kv_heads * shares < 2 * sm_count(device):
        shares *= 2
    return min(shares, next_pow2(max_splits))


def decode(launch: Launch, seq_lens: torch.Tensor, block_tables: torch.Tensor,
           out: torch.Tensor) -> None:
    """One query a sequence (query row i is sequence i's)."""
    query, kv = launch.query, launch.kv_cache
    shape = tile.layout(query, kv)
    batch, heads, kv_heads = seq_lens.shape[0], query.shape[1], kv.shape[3]
    max_splits = max(1, cdiv(block_tables.shape[1] * kv.shape[2], tile.SPLIT_TOKENS))
    shares = shares_for(batch, kv_heads, max_splits, query.device)
    part_o = torch.empty((batch * max_splits * heads, query.shape[2]) if max_splits > 1 else (1, 1),
                         dtype=torch.float32, device=query.device)
    part_ml = torch.empty((batch * max_splits * heads, 2) if max_splits > 1 else (1, 2),
                          dtype=torch.float32, device=query.device)
    options = tile.common(launch)
    _decode_kernel[(kv_heads * shares, batch)](
        query, kv[0], kv[1], out, seq_lens, block_tables, part_o, part_ml, launch.qk_scale,
        launch.v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *launch.cache_strides, max_splits, heads, SHARES=shares, **shape, **options,
        **tile.launch_options(query))
    if max_splits > 1:
        _combine_kernel[(batch, kv_heads)](
            seq_lens, part_o, part_ml, out, launch.v_scale, out.stride(0), out.stride(1),
            max_splits, heads, SPLIT_TOKENS=tile.SPLIT_TOKENS, G=shape["G"], G_PAD=shape["G_PAD"],
            HEAD_DIM=shape["HEAD_DIM"], num_warps=4, enable_fp_fusion=False)
