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

The canonical order (every launch here computes exactly it, for every row):

* keys are cut into splits of ``SPLIT_TOKENS`` positions from position 0 (a multiple of the
  key tile BLOCK_N); within a split, an online softmax in float32 over key tiles of BLOCK_N
  (``triton_flash._attend``, starting from m = -inf, l = 0, acc = 0);
* the splits are folded in order into (M, L, A) (``_fold``: M' = max(M, m), A' = fma(a,
  exp2(m - M'), A exp2(M - M')), the same for L), starting from (-inf, 0, 0);
* out = A v_scale / L.

Every launch uses one tile (``BLOCK_M`` rows = query tokens x the padded GQA group, BLOCK_N
keys, ``WARPS``, ``STAGES``) whatever the step, so a row's dot products run the same tensor-core
instructions in the same order; FMA contraction is off (``enable_fp_fusion=False``) so that the
few scalar formulas compile alike in every kernel. A key tile wholly past a row's position adds
exact zeros (p = 0, alpha = 1), so a row of a prefill tile, which walks the keys of the tile's
last query, gets the bits of the same row computed alone.

Launches: prefill and mixed steps' prefill rows (``prefill``, grid as
``triton_attention``'s) and the full graphs' one launch (``unified``, grid as
``triton_unified``'s) walk every split of a tile in one program, folding as they go (a second
float32 accumulator). Decode rows (``decode``) run one program per (KV head, sequence, share of
its splits); a split's float32 partial (m, l, a) goes to a workspace and a combine kernel folds
them in split order, so a long context is spread over the SMs at any batch size. A context of
one split (<= SPLIT_TOKENS) is finished by its one program, without the workspace.

What it gives up against the default kernels: the tile is not sized per step (64 rows, not up
to 256: a long prefill reloads K/V more often), decodes run the tensor cores on a 64-row tile
of which one token's heads are real, a long decode is split into fixed 512-token shares rather
than as many as the SMs want, and a decode of a context past one split pays the combine. What
it keeps: the paged cache as is (block tables, FP8 KV with its scales), CUDA graphs (no host
sync; the decode's split count comes from the block-table width), and no atomics.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.host import cdiv, next_pow2
from kernels.skinny_gemm import sm_count
from kernels.triton_flash import Launch, _attend, _query_operand
from kernels.triton_unified import _find_seq, num_programs

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


def _layout(query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    """The tile constants of a call: the GQA group padded, query tokens a tile."""
    heads, kv_heads = query.shape[1], kv_cache.shape[3]
    group = heads // kv_heads
    g_pad = next_pow2(group)
    if g_pad > BLOCK_M:
        raise ValueError(f"a GQA group of {group} query heads does not fit a {BLOCK_M}-row tile")
    return dict(G=group, G_PAD=g_pad, BLOCK_Q=BLOCK_M // g_pad, HEAD_DIM=query.shape[2],
                BLOCK_N=BLOCK_N, BLOCK_SIZE=kv_cache.shape[2], SPLIT_TOKENS=SPLIT_TOKENS)


def _common(launch: Launch) -> dict:
    return dict(PRECISION=launch.precision, DOT_F32=launch.dot_f32, KV_F16=launch.kv_f16,
                V_T=launch.v_t)


def _launch_options(query: torch.Tensor) -> dict:
    wide = query.element_size() > 2
    return dict(num_warps=WARPS, num_stages=1 if wide else STAGES, enable_fp_fusion=False)


def prefill(launch: Launch, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, out: torch.Tensor, seq0: int, max_query_len: int) -> None:
    """Sequences seq0.. of the call (their rows at query_start_loc's offsets)."""
    query, kv = launch.query, launch.kv_cache
    layout = _layout(query, kv)
    grid = (cdiv(max_query_len, layout["BLOCK_Q"]), kv.shape[3], seq_lens.shape[0] - seq0)
    _prefill_kernel[grid](query, kv[0], kv[1], out, query_start_loc, seq_lens, block_tables, seq0,
                          launch.qk_scale, launch.v_scale, query.stride(0), query.stride(1),
                          out.stride(0), out.stride(1), *launch.cache_strides, **layout,
                          **_common(launch), **_launch_options(query))


def _shares(batch: int, kv_heads: int, max_splits: int, device: torch.device) -> int:
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
    layout = _layout(query, kv)
    batch, heads, kv_heads = seq_lens.shape[0], query.shape[1], kv.shape[3]
    max_splits = max(1, cdiv(block_tables.shape[1] * kv.shape[2], SPLIT_TOKENS))
    shares = _shares(batch, kv_heads, max_splits, query.device)
    part_o = torch.empty((batch * max_splits * heads, query.shape[2]) if max_splits > 1 else (1, 1),
                         dtype=torch.float32, device=query.device)
    part_ml = torch.empty((batch * max_splits * heads, 2) if max_splits > 1 else (1, 2),
                          dtype=torch.float32, device=query.device)
    common = _common(launch)
    _decode_kernel[(kv_heads * shares, batch)](
        query, kv[0], kv[1], out, seq_lens, block_tables, part_o, part_ml, launch.qk_scale,
        launch.v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *launch.cache_strides, max_splits, heads, SHARES=shares, **layout, **common,
        **_launch_options(query))
    if max_splits > 1:
        _combine_kernel[(batch, kv_heads)](
            seq_lens, part_o, part_ml, out, launch.v_scale, out.stride(0), out.stride(1),
            max_splits, heads, SPLIT_TOKENS=SPLIT_TOKENS, G=layout["G"], G_PAD=layout["G_PAD"],
            HEAD_DIM=layout["HEAD_DIM"], num_warps=4, enable_fp_fusion=False)


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())   # syncs with the device


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, decode_only: bool | None = None,
                    num_decodes: int = 0, decode_order: torch.Tensor | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.triton_attention.paged_attention``'s interface and hints (``decode_order`` is
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
    """``kernels.triton_unified.unified_attention``'s interface (padded sequences of q_len 0,
    rows past the last real token left as they are), every row batch-invariant."""
    tokens = query.shape[0]
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tokens == 0:
        return out
    launch = Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    layout = _layout(query, kv_cache)
    seqs = seq_lens.shape[0]
    grid = (num_programs(tokens, seqs, layout["BLOCK_Q"]), kv_cache.shape[3])
    _unified_kernel[grid](query, kv_cache[0], kv_cache[1], out, query_start_loc, seq_lens,
                          block_tables, seqs, launch.qk_scale, launch.v_scale, query.stride(0),
                          query.stride(1), out.stride(0), out.stride(1), *launch.cache_strides,
                          **layout, **_common(launch), **_launch_options(query))
    return out
