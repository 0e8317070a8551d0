"""Triton paged attention over the ``[2, blocks, block_size, kv_heads, head_dim]`` KV cache.

Two attention kernels share one inner loop (``_attend``: gather a tile of keys through the block
table, online softmax in float32 with exp2, accumulate P @ V):

* decode (every sequence has exactly one query token): grid (kv head x kv split, sequence); one
  program handles all query heads of its KV head (the GQA group, padded to >= 16 rows for
  tl.dot) over one contiguous share of the context (flash-decoding). The number of splits is a
  power of two chosen from static shapes only (batch, kv heads, block-table width), so the launch
  needs no host sync and can be captured in a CUDA graph; ``_combine_kernel`` then merges the
  splits' partial outputs by their log-sum-exp. An optional order (the host sorts the batch by
  context, longest first) starts the long sequences' programs first, so ragged batches do not
  end on a wave of one long sequence.
* prefill / mixed batches: grid (query tile, kv head, sequence); a tile's rows are BLOCK_Q query
  tokens x the GQA group, so each K/V tile is loaded once per group. Sequence i's queries are the
  last q_len_i of its seq_lens[i] positions and attend causally to the cache, whose K/V for the
  new tokens are already written. Key tiles wholly below the tile's first query skip all
  masking; tiles run longest-first.

Keys at or past a sequence's length are never loaded (masked loads, other=0) and get -inf scores,
so unwritten slots, which may hold NaN, cannot leak in. head_dim must be a power of two >= 16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Launch configuration, tuned on an H200 (triton 3.6) with ``bench/kernels.py --sweep``: decode
# reaches 3.8-4.4 TB/s at batch >= 64, causal bf16 prefill 300-450 TFLOP/s (hd 128, GQA 4).
DECODE_BLOCK_N, DECODE_WARPS, DECODE_STAGES = 64, 4, 3     # BLOCK_N: keys per loop iteration
PREFILL_BLOCK_M = 256                                      # rows (query tokens x group) per tile
PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 64, 8, 3
MIN_SPLIT_TOKENS = 256     # a decode split gets at least this much of the longest context
MAX_SPLITS = 32
# Triton's CPU interpreter multiplies bfloat16 tl.dot operands as raw bits (triton issue 11584),
# so under it bfloat16 operands are widened to float32 first (DOT_F32); compiled kernels never are.
_INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def _operand(x, DOT_F32: tl.constexpr):
    if DOT_F32:
        return x.to(tl.float32)
    return x


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head_off, lo, hi, q_pos, qk_scale,
            stride_block, stride_slot, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
            DOT_F32: tl.constexpr, dtype: tl.constexpr):
    """Folds keys [lo, hi) into the running (acc, l_i, m_i). MASKED: a tile may run past hi or
    past a row's query position; otherwise every tile is full and visible to every row.
    K/V are read as ``dtype`` (the query's: an FP8 cache is widened, its scales applied by the
    caller: k_scale in qk_scale, v_scale on the output)."""
    d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        if MASKED:  # keys past hi are never loaded: unwritten slots may hold NaN
            live = k_pos < hi
            block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
            off = block * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head_off
            k = tl.load(K + off[:, None] + d[None, :], mask=live[:, None], other=0.0).to(dtype)
            v = tl.load(V + off[:, None] + d[None, :], mask=live[:, None], other=0.0).to(dtype)
        else:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
            off = block * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head_off
            k = tl.load(K + off[:, None] + d[None, :]).to(dtype)
            v = tl.load(V + off[:, None] + d[None, :]).to(dtype)
        s = tl.dot(q, tl.trans(_operand(k, DOT_F32)), input_precision=PRECISION)
        if MASKED:
            s = tl.where(live[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # m, p in the scaled log2 domain
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = _operand(p.to(dtype), DOT_F32)
        acc = tl.dot(p, _operand(v, DOT_F32), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Block-table widths vary from step to step in eager (mixed) steps: no specialisation on them,
# or every new width divisibility would compile a variant in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q, K, V, SEQ_LENS, BT, ORDER, PART_O, PART_LSE, OUT, qk_scale, v_scale, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                   stride_head, NUM_SPLITS: tl.constexpr,
                   G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_F32: tl.constexpr, HAS_ORDER: tl.constexpr):
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
    q = _operand(tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                         mask=(rows < G)[:, None], other=0.0), DOT_F32)
    chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    q_pos = tl.full([G_PAD], ctx - 1, tl.int32)  # the one query sees every key below ctx
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, BT + seq * stride_bt, kv_head * stride_head,
                            lo, hi, q_pos, qk_scale, stride_block,
                            stride_slot, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, PRECISION, DOT_F32,
                            Q.dtype.element_ty)
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


@triton.jit(do_not_specialize=["seq0", "stride_bt"])   # both vary per step: one variant
def _prefill_kernel(Q, K, V, OUT, QSL, SEQ_LENS, BT, seq0, qk_scale, v_scale, stride_qt, stride_qh, stride_ot,
                    stride_oh, stride_bt, stride_block, stride_slot, stride_head,
                    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    # Tiles run last-first: the causal tail's longest tiles start early, the short ones fill in.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head, seq = tl.program_id(1), seq0 + tl.program_id(2)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(SEQ_LENS + seq)
    rows = tl.arange(0, BLOCK_Q * G_PAD)  # row = query token * G_PAD + head within the group
    tok = tile * BLOCK_Q + rows // G_PAD
    heads = kv_head * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = _operand(q, DOT_F32)
    q_pos = ctx - q_len + tok
    first = ctx - q_len + tile * BLOCK_Q        # position of the tile's first query
    below = (first + 1) // BLOCK_N * BLOCK_N    # keys [0, below) are visible to every row
    end = tl.minimum(ctx, first + BLOCK_Q)      # the tile's last query sees keys [0, end)
    acc = tl.zeros([BLOCK_Q * G_PAD, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
    bt_row = BT + seq * stride_bt
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head * stride_head, 0, below,
                            q_pos, qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE,
                            HEAD_DIM, False, PRECISION, DOT_F32, Q.dtype.element_ty)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head * stride_head, below, end,
                            q_pos, qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE,
                            HEAD_DIM, True, PRECISION, DOT_F32, Q.dtype.element_ty)
    out = acc * v_scale / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(OUT + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


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


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())  # syncs with the device


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, decode_only: bool | None = None,
                    num_kv_splits: int | None = None, num_decodes: int = 0,
                    decode_order: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of variable-length queries over paged KV; see
    kernels.reference.paged_attention. Host-side hints avoid a device sync: ``decode_only=True``
    promises every sequence has exactly one query token; otherwise ``max_query_len`` (the longest
    q_len) is needed, and found with one sync when not given. All q_len == 1 takes the decode
    kernel either way. ``num_kv_splits`` (a power of two) overrides num_decode_splits.
    ``num_decodes``: the first that many sequences of a mixed batch have one query token each;
    they take the decode kernel (a prefill tile would pad each of them to BLOCK_Q tokens).
    ``decode_order`` (int32, a permutation of the decode rows, longest context first) is the
    order their programs start in: a scheduling hint that leaves the result unchanged."""
    tokens, heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    if not decode_only:
        max_query_len = max_query_len or _max_query_len(query_start_loc)
        decode_only = tokens == batch and max_query_len == 1
    launch = _Launch(query, kv_cache, block_tables, scale, k_scale, v_scale)
    if decode_only:
        launch.decode(seq_lens, block_tables, out, num_kv_splits, decode_order)
        return out
    if num_decodes:   # the decodes' rows are the first num_decodes of query, seq_lens, tables
        launch.decode(seq_lens[:num_decodes], block_tables[:num_decodes], out[:num_decodes],
                      num_kv_splits, decode_order)
    launch.prefill(query_start_loc, seq_lens, block_tables, out, num_decodes, max_query_len)
    return out


class _Launch:
    """What the decode and prefill launches of one attention call share."""

    def __init__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 scale: float, k_scale: float = 1.0, v_scale: float = 1.0):
        self.query, self.kv_cache = query, kv_cache
        self.dot_f32 = _INTERPRETED and query.dtype == torch.bfloat16
        self.precision = "ieee" if query.dtype == torch.float32 or self.dot_f32 else "tf32"
        keys = kv_cache[0]
        self.cache_strides = (block_tables.stride(0), keys.stride(0), keys.stride(1), keys.stride(2))
        fp8 = kv_cache.dtype == torch.float8_e4m3fn   # an FP8 cache holds k / k_scale, v / v_scale
        self.qk_scale = scale * _LOG2E * (k_scale if fp8 else 1.0)
        self.v_scale = v_scale if fp8 else 1.0

    def decode(self, seq_lens: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor,
               num_kv_splits: int | None, order: torch.Tensor | None) -> None:
        query, (keys, values) = self.query, (self.kv_cache[0], self.kv_cache[1])
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
        _decode_kernel[(kv_heads * splits, batch)](
            query, keys, values, seq_lens, block_tables, seq_lens if order is None else order,
            part_o, part_lse, out, self.qk_scale, self.v_scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), *self.cache_strides,
            NUM_SPLITS=splits, G=group,
            G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_N=DECODE_BLOCK_N, BLOCK_SIZE=block_size, PRECISION=self.precision,
            DOT_F32=self.dot_f32, HAS_ORDER=order is not None, num_warps=DECODE_WARPS,
            num_stages=DECODE_STAGES)
        if splits > 1:
            _combine_kernel[(batch, heads)](part_o, part_lse, out, out.stride(0), out.stride(1),
                                            NUM_SPLITS=splits, HEAD_DIM=head_dim, num_warps=4)

    def prefill(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, out: torch.Tensor, seq0: int, max_query_len: int) -> None:
        """Sequences seq0.. (the rows' offsets in query stay absolute: query_start_loc's)."""
        query, (keys, values) = self.query, (self.kv_cache[0], self.kv_cache[1])
        _, heads, head_dim = query.shape
        kv_heads, block_size = keys.shape[2], keys.shape[1]
        group = heads // kv_heads
        g_pad = triton.next_power_of_2(group)
        wide = query.element_size() > 2  # float32: a quarter of the tile and fewer stages fit smem
        block_m = min(PREFILL_BLOCK_M // (4 if wide else 1),
                      max(16, triton.next_power_of_2(max_query_len) * g_pad))
        block_q = block_m // g_pad
        grid = (triton.cdiv(max_query_len, block_q), kv_heads, seq_lens.shape[0] - seq0)
        _prefill_kernel[grid](
            query, keys, values, out, query_start_loc, seq_lens, block_tables,
            seq0, self.qk_scale, self.v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *self.cache_strides, G=group, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
            BLOCK_N=PREFILL_BLOCK_N, BLOCK_SIZE=block_size, PRECISION=self.precision,
            DOT_F32=self.dot_f32, num_warps=PREFILL_WARPS if block_m >= 128 else 4,
            num_stages=2 if wide else PREFILL_STAGES)
