"""The canonical order of ``--deterministic``'s attention, shared by every launch of it
(``headrace.kernels.triton_invariant_attention``: prefill, mixed and full-graph launches;
``headrace.kernels.triton_invariant_decode``: decodes): a query row's output bits are a function of its
query, its position and its sequence's cached keys and values only.

* keys are cut into splits of ``SPLIT_TOKENS`` positions from position 0 (a multiple of the
  key tile BLOCK_N); within a split, an online softmax in float32 over key tiles of BLOCK_N
  (``triton_flash._attend``, starting from m = -inf, l = 0, acc = 0): ``_split``;
* the splits are folded in order into (M, L, A) (``_fold``: M' = max(M, m), A' = fma(a,
  exp2(m - M'), A exp2(M - M')), the same for L), starting from (-inf, 0, 0);
* out = A v_scale / L.

Every launch uses one tile (``BLOCK_M`` rows = query tokens x the padded GQA group, BLOCK_N
keys, ``WARPS``, ``STAGES``) whatever the step, so a row's dot products run the same tensor-core
instructions in the same order; FMA contraction is off (``enable_fp_fusion=False``) so that the
few scalar formulas compile alike in every kernel. A key tile wholly past a row's position adds
exact zeros (p = 0, alpha = 1), so a row of a prefill tile, which walks the keys of the tile's
last query, gets the bits of the same row computed alone. ``_det_tile`` is a query tile over
every split of its keys, folding in registers (a second float32 accumulator).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from headrace.kernels.host import next_pow2
from headrace.kernels.triton_flash import Launch, _attend, _query_operand

# Part of the numerics: outputs are bit-identical only between runs with the same values (the
# variables are benchmark knobs: bench/det_kernels.py sweeps them).
SPLIT_TOKENS = int(os.environ.get("HEADRACE_DET_SPLIT_TOKENS", "512"))
BLOCK_M, BLOCK_N, WARPS, STAGES = (int(v) for v in os.environ.get(
    "HEADRACE_DET_ATTENTION_TILE", "64,64,4,2").split(","))   # rows, keys, warps, stages
if SPLIT_TOKENS % BLOCK_N:
    raise ValueError(f"HEADRACE_DET_SPLIT_TOKENS={SPLIT_TOKENS}: must be a multiple of {BLOCK_N}")


@triton.jit
def _fold(M, L, A, m, l, a):
    """(M, L, A) followed by a split's (m, l, a): rows' running max, sum and accumulator. A
    row that sees no key of the split (m = -inf: the split starts past its position; its l and
    a are NaN then) keeps its state."""
    m2 = tl.maximum(M, m)
    safe = tl.where(m2 == float("-inf"), 0.0, m2)
    c1 = tl.exp2(M - safe)
    c2 = tl.exp2(m - safe)
    empty = m == float("-inf")
    L2 = tl.where(empty, L, tl.fma(l, c2, L * c1))
    A2 = tl.where(empty[:, None], A, tl.fma(a, c2[:, None], A * c1[:, None]))
    return tl.where(empty, M, m2), L2, A2


@triton.jit
def _split(q, K, V, bt_row, kv_head_off, lo, hi, below, q_pos, qk_scale, stride_block,
           stride_slot, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
           V_T: tl.constexpr):
    """One split's online softmax over keys [lo, hi) from a fresh state: (m, l, acc); keys
    below ``below`` are visible to every row (no mask)."""
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    mid = tl.minimum(tl.maximum(below, lo), hi)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head_off, lo, mid, q_pos,
                            qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                            False, PRECISION, DOT_F32, q.dtype, V_T, V_T)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head_off, mid, hi, q_pos,
                            qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                            True, PRECISION, DOT_F32, q.dtype, V_T, V_T)
    return m_i, l_i, acc


@triton.jit
def _tile_rows(Q, seq, tile, kv_head, q_start, q_len, ctx, stride_qt, stride_qh,
               G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
               HEAD_DIM: tl.constexpr, KV_F16: tl.constexpr, DOT_F32: tl.constexpr):
    """A query tile's rows (token x padded group head): its tokens, heads, which rows are real,
    the query operand and each row's position."""
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = tile * BLOCK_Q + rows // G_PAD
    heads = kv_head * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    return tok, heads, row_ok, _query_operand(q, KV_F16, DOT_F32), ctx - q_len + tok


@triton.jit
def _det_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, ctx, qk_scale, v_scale,
              stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
              stride_head, SPLIT_TOKENS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
              BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
              KV_F16: tl.constexpr, V_T: tl.constexpr):
    """A query tile over every split of its keys, folded in order, written to OUT."""
    ROWS: tl.constexpr = BLOCK_Q * G_PAD
    tok, heads, row_ok, q, q_pos = _tile_rows(Q, seq, tile, kv_head, q_start, q_len, ctx,
                                              stride_qt, stride_qh, G, G_PAD, BLOCK_Q, HEAD_DIM,
                                              KV_F16, DOT_F32)
    first = ctx - q_len + tile * BLOCK_Q        # position of the tile's first query
    below = (first + 1) // BLOCK_N * BLOCK_N    # keys [0, below) are visible to every row
    end = tl.minimum(ctx, first + BLOCK_Q)      # the tile's last query sees keys [0, end)
    bt_row = BT + seq * stride_bt
    M = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    L = tl.zeros([ROWS], dtype=tl.float32)
    A = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for lo in range(0, end, SPLIT_TOKENS):
        m, l, a = _split(q, K, V, bt_row, kv_head * stride_head, lo,
                         tl.minimum(end, lo + SPLIT_TOKENS), below, q_pos, qk_scale,
                         stride_block, stride_slot, ROWS, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PRECISION,
                         DOT_F32 and not KV_F16, V_T)
        M, L, A = _fold(M, L, A, m, l, a)
    out = A * v_scale / tl.where(row_ok & (L > 0), L, 1.0)[:, None]
    d = tl.arange(0, HEAD_DIM)
    tl.store(OUT + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None])

def layout(query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    """The tile constants of a call: the GQA group padded, query tokens a tile."""
    heads, kv_heads = query.shape[1], kv_cache.shape[3]
    group = heads // kv_heads
    g_pad = next_pow2(group)
    if g_pad > BLOCK_M:
        raise ValueError(f"a GQA group of {group} query heads does not fit a {BLOCK_M}-row tile")
    return dict(G=group, G_PAD=g_pad, BLOCK_Q=BLOCK_M // g_pad, HEAD_DIM=query.shape[2],
                BLOCK_N=BLOCK_N, BLOCK_SIZE=kv_cache.shape[2], SPLIT_TOKENS=SPLIT_TOKENS)


def common(launch: Launch) -> dict:
    return dict(PRECISION=launch.precision, DOT_F32=launch.dot_f32, KV_F16=launch.kv_f16,
                V_T=launch.v_t)


def launch_options(query: torch.Tensor) -> dict:
    wide = query.element_size() > 2
    return dict(num_warps=WARPS, num_stages=1 if wide else STAGES, enable_fp_fusion=False)


