"""The inner loop both Triton paged-attention kernels share (``headrace.kernels.triton_decode`` and
``headrace.kernels.triton_attention``'s prefill; ``_causal_tile``: a query tile of the prefill and
the unified kernels, ``headrace.kernels.triton_unified``), and what every Triton module needs to
know about running under Triton's CPU interpreter.

``_attend`` gathers a tile of keys through the block table, scores it with tl.dot (tensor
cores), folds it into an online softmax in float32 in the log2 domain (exp2 is the hardware's
native exponential) and accumulates P @ V; decode and prefill differ only in the tile of query
rows they hold and in how they split the context over programs. ``Launch`` holds the
per-call parameters both launches derive from the query and the cache.

An FP8 (e4m3) cache is read as such (half the bytes of bf16) and widened in registers, tile by
tile, never as a whole. By default (``FP8_COMPUTE = "float16"``) the query, the widened K/V
tiles and the probabilities are float16 for the tensor cores: e4m3 -> float16 is one native
conversion per two values on SM89+ (``cvt.rn.f16x2.e4m3x2``; to bfloat16 it takes a detour
through float32), e4m3's values are exact in float16, and float16 keeps 3 more mantissa bits
of q and P than bfloat16 (q is clamped to float16's range first). ``"query"`` widens to the
query's dtype instead (the first version; the bench compares both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels import kv_layout

LOG2E = 1.4426950408889634
FP8_COMPUTE = "float16"    # or "query": the dtype an FP8 cache's tiles widen to
# Triton's CPU interpreter multiplies bfloat16 tl.dot operands as raw bits (triton issue 11584),
# so under it bfloat16 operands are widened to float32 first (DOT_F32); compiled kernels never are.
INTERPRETED = triton.knobs.runtime.interpret


@triton.jit
def _operand(x, DOT_F32: tl.constexpr):
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _query_operand(q, KV_F16: tl.constexpr, DOT_F32: tl.constexpr):
    """The query as a tl.dot operand: float16 (clamped to its range) over an FP8 cache read
    as float16, else as loaded (float32 under the interpreter's bfloat16 workaround)."""
    # one return statement: compiled Triton rejects returns of different types, even under a
    # constexpr branch (the interpreter does not)
    if KV_F16:
        out = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        out = _operand(q, DOT_F32)
    return out


@triton.jit
def _value_tile_t(V, block, k_pos, v_head_off, stride_block, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Values of keys k_pos (BLOCK_N consecutive from a multiple of BLOCK_N; ``block``: each
    key's block, equal over a block's keys) from a cache that stores V transposed within each
    block (``[head_dim, block_size]`` per block and head, the FP8 layout): [BLOCK_N, HEAD_DIM],
    read along the keys in runs of a block (16-byte copies), so that the tile reaches the
    tensor cores by ``ldmatrix`` with no trip through registers and back. Never masked: a
    per-key mask along the run is not vectorised (a context's last tile was read a byte at a
    time), so a tile past a context reads its blocks' other slots whole, which hold finite
    values (``headrace.kernels.kv_layout``: an FP8 cache holds no NaN) and weigh nothing (p = 0)."""
    SPAN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N   # keys in one run
    off = (block * stride_block + v_head_off + k_pos % BLOCK_SIZE)[:, None] \
        + tl.arange(0, HEAD_DIM)[None, :] * BLOCK_SIZE
    off = tl.max_contiguous(tl.multiple_of(off, [SPAN, 1]), [SPAN, 1])
    return tl.load(V + off)


@triton.jit
def _tile_blocks(bt_row, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 MASKED: tl.constexpr):
    """The block of each of keys start..start+BLOCK_N (start a multiple of BLOCK_N), from one
    load of the tile's BLOCK_N // BLOCK_SIZE block-table entries spread over its keys. Why: over
    an FP8 cache K (token-major) and V (transposed) are gathered in two register layouts, and a
    per-key load of the table (``bt_row + k_pos // BLOCK_SIZE``) was compiled once per layout,
    as 4-byte cp.async of every key's entry: 108 in the prefill kernel's PTX against 18 this
    way, which measured prefill over FP8 at 277-298 TFLOP/s against 295-321 (H200, 2026-12-03,
    ``bench.fp8_kv_attention``'s prefill rows). MASKED: entries of blocks at or past ``hi``
    read as block 0 (any block: the keys are masked)."""
    if BLOCK_SIZE >= BLOCK_N:
        blk = tl.load(bt_row + start // BLOCK_SIZE)
        block = tl.full([BLOCK_N], 0, tl.int64) + blk.to(tl.int64)
    else:
        NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
        idx = start // BLOCK_SIZE + tl.arange(0, NB)
        if MASKED:
            blocks = tl.load(bt_row + idx, mask=idx * BLOCK_SIZE < hi, other=0)
        else:
            blocks = tl.load(bt_row + idx)
        spread = tl.broadcast_to(blocks.to(tl.int64)[:, None], (NB, BLOCK_SIZE))
        block = tl.reshape(spread, (BLOCK_N,))
    return block


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head_off, lo, hi, q_pos, qk_scale,
            stride_block, stride_slot, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
            DOT_F32: tl.constexpr, dtype: tl.constexpr, V_T: tl.constexpr,
            TILE_BT: tl.constexpr = False):
    """Folds keys [lo, hi) into the running (acc, l_i, m_i). MASKED: a tile may run past hi or
    past a row's query position; otherwise every tile is full and visible to every row.
    TILE_BT: the tile's block-table entries read once (``_tile_blocks``; the prefill and
    unified kernels over a cache with V transposed; decode's compiled code did not need it).
    K/V are read as ``dtype`` (the query's: an FP8 cache is widened, its scales applied by the
    caller: k_scale in qk_scale, v_scale on the output)."""
    d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        if MASKED:  # keys past hi: K and token-major V not loaded (unwritten slots may be NaN)
            live = k_pos < hi
            if TILE_BT:
                block = _tile_blocks(bt_row, start, hi, BLOCK_N, BLOCK_SIZE, True)
            elif V_T:   # a transposed V is read in whole blocks: each key of a block gets its block
                in_block = k_pos // BLOCK_SIZE * BLOCK_SIZE < hi
                block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=in_block, other=0).to(tl.int64)
            else:
                block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
            off = block * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head_off
            k = tl.load(K + off[:, None] + d[None, :], mask=live[:, None], other=0.0).to(dtype)
            if V_T:   # keys past hi read finite values (headrace.kernels.kv_layout), their p is 0
                v = _value_tile_t(V, block, k_pos, kv_head_off * BLOCK_SIZE, stride_block,
                                  BLOCK_N, BLOCK_SIZE, HEAD_DIM).to(dtype)
            else:
                v = tl.load(V + off[:, None] + d[None, :], mask=live[:, None], other=0.0).to(dtype)
        else:
            if TILE_BT:
                block = _tile_blocks(bt_row, start, hi, BLOCK_N, BLOCK_SIZE, False)
            else:
                block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
            off = block * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head_off
            k = tl.load(K + off[:, None] + d[None, :]).to(dtype)
            if V_T:
                v = _value_tile_t(V, block, k_pos, kv_head_off * BLOCK_SIZE, stride_block,
                                  BLOCK_N, BLOCK_SIZE, HEAD_DIM).to(dtype)
            else:
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


@triton.jit
def _causal_tile(Q, K, V, OUT, BT, seq, tile, kv_head, q_start, q_len, ctx, qk_scale, v_scale,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
                 stride_head, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 PRECISION: tl.constexpr, DOT_F32: tl.constexpr, KV_F16: tl.constexpr,
                 V_T: tl.constexpr):
    """One query tile of a sequence (its queries are the last q_len of its ctx positions, at
    rows q_start.. of Q and OUT): BLOCK_Q tokens x the GQA group as the tile's rows, so a K/V
    tile is loaded once per group; keys below the tile's first query unmasked, the causal
    diagonal masked. The prefill kernel and the unified kernel differ only in how a program
    finds its (sequence, tile)."""
    rows = tl.arange(0, BLOCK_Q * G_PAD)  # row = query token * G_PAD + head within the group
    tok = tile * BLOCK_Q + rows // G_PAD
    heads = kv_head * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = _query_operand(q, KV_F16, DOT_F32)
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
                            HEAD_DIM, False, PRECISION, DOT_F32 and not KV_F16, q.dtype, V_T, V_T)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, bt_row, kv_head * stride_head, below, end,
                            q_pos, qk_scale, stride_block, stride_slot, BLOCK_N, BLOCK_SIZE,
                            HEAD_DIM, True, PRECISION, DOT_F32 and not KV_F16, q.dtype, V_T, V_T)
    out = acc * v_scale / tl.where(row_ok & (l_i > 0), l_i, 1.0)[:, None]
    tl.store(OUT + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


class Launch:
    """What the decode and prefill launches of one attention call share."""

    def __init__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 scale: float, k_scale: float = 1.0, v_scale: float = 1.0):
        self.query, self.kv_cache = query, kv_cache
        self.dot_f32 = INTERPRETED and query.dtype == torch.bfloat16
        self.precision = "ieee" if query.dtype == torch.float32 or self.dot_f32 else "tf32"
        keys = kv_cache[0]
        self.cache_strides = (block_tables.stride(0), keys.stride(0), keys.stride(1), keys.stride(2))
        fp8 = kv_cache.dtype == torch.float8_e4m3fn   # an FP8 cache holds k / k_scale, v / v_scale
        self.qk_scale = scale * LOG2E * (k_scale if fp8 else 1.0)
        self.v_scale = v_scale if fp8 else 1.0
        self.fp8 = fp8
        # values stored transposed within each block (an FP8 cache), read by offsets the
        # kernels derive from a contiguous cache's shape
        self.v_t = kv_layout.values_transposed(kv_cache.dtype)
        if self.v_t and not kv_cache.is_contiguous():
            raise ValueError("an FP8 KV cache must be contiguous (its values are read by "
                             "offsets from its shape)")
        # K/V tiles widen to float16 (a float32 query keeps float32: tests, CPU-sized models)
        self.kv_f16 = fp8 and FP8_COMPUTE == "float16" and query.dtype != torch.float32
