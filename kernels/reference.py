"""Plain-torch reference implementations of the data plane's hot kernels.

These are the semantics every Triton kernel in this package must reproduce; the
data plane runs them on CPU, and tests compare the Triton kernels against them.

Paged KV layout (per layer): ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values,
each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (an FP8 cache stores its values
transposed within each block: ``headrace.kernels.kv_layout``, whose ``values`` view reads them by
token). A token's slot is
``block_id * block_size + offset``; slot ``-1`` marks a padded token that is not written.
An FP8 cache (float8_e4m3fn) stores ``k / k_scale`` and ``v / v_scale`` (per-tensor scales,
saturated at +-448) and attention reads them back times the scale; other caches ignore them.
"""

from __future__ import annotations

import torch

from headrace.kernels import kv_layout


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (as Hugging Face does)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): a projection (weight [out, in], as nn.Linear holds it)."""
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where gate_up is [..., 2 * d] with gate first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding. x: [tokens, heads, head_dim]; cos_sin: [max_pos, head_dim]
    holding cos in the first half and sin in the second (float32)."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions]
    cos = cs[:, None, :half].to(x.dtype)
    sin = cs[:, None, half:].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _to_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    # NaN stored as 0: an FP8 cache holds no NaN (headrace.kernels.kv_layout)
    return (x.float() / scale).nan_to_num(nan=0.0).clamp(-448.0, 448.0).to(dtype)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Stores key/value [tokens, kv_heads, head_dim] at their slots; slot -1 is skipped."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = _to_cache(key[keep], k_scale, kv_cache.dtype)
    kv_layout.values(kv_cache)[blocks, offsets] = _to_cache(value[keep], v_scale, kv_cache.dtype)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    """The attention prologue: per-head RMSNorm of q and k (when the model has one, as Qwen3),
    rotary embedding of both, k and v stored at their slots; returns q [tokens, heads, head_dim].
    q/k/v may be strided views of the qkv projection."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q = apply_rotary(q, positions, cos_sin)
    write_kv(kv_cache, apply_rotary(k, positions, cos_sin), v, slot_mapping, k_scale, v_scale)
    return q


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ctx cached entries of one sequence: [ctx, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (ctx + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:ctx]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of variable-length queries over their sequences' paged KV.

    query: [tokens, heads, head_dim], packed by sequence (query_start_loc is [B+1]);
    sequence i's queries are its last q_len_i tokens of seq_lens[i] (their K/V already
    written). Keys past seq_lens[i] are never read, so unwritten slots cannot leak in.
    Returns [tokens, heads, head_dim] in the query's dtype.
    """
    out = torch.empty_like(query)
    heads, kv_heads = query.shape[1], kv_cache.shape[3]
    group = heads // kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if kv_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    for i, ctx in enumerate(lens):
        q = query[starts[i]:starts[i + 1]].float()  # [n, H, D]
        n = q.shape[0]
        if n == 0:
            continue
        k = _gather_context(kv_cache[0], block_tables[i], ctx).float().repeat_interleave(group, 1)
        v = _gather_context(kv_layout.values(kv_cache), block_tables[i], ctx).float()
        v = v.repeat_interleave(group, 1)
        k, v = k * k_scale, v * v_scale
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        scores.masked_fill_((k_pos > q_pos).to(scores.device), float("-inf"))
        probs = scores.softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


# splitmix64 constants as signed 64-bit integers (torch has no uint64 arithmetic)
GOLDEN = -7046029254386353131      # 0x9E3779B97F4A7C15
MIX1 = -4658895280553007687        # 0xBF58476D1CE4E5B9
MIX2 = -7723592293110705685        # 0x94D049BB133111EB
# 32-bit constants: a Weyl multiplier for the token id and murmur3's finalizer
TOKEN_MUL, FMIX1, FMIX2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_LOW32 = (1 << 32) - 1


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def race_row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """splitmix64 of (seed, counter): one 64-bit key per row and step (int64 bits)."""
    x = (seeds * GOLDEN) ^ (counters * MIX2)
    x = x + GOLDEN
    x = (x ^ _srl(x, 30)) * MIX1
    x = (x ^ _srl(x, 27)) * MIX2
    return x ^ _srl(x, 31)


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] (float32): the same bits on every device and whatever else is
    in the batch. Each row's 64-bit key (``race_row_keys``) is mixed with the token id in 32-bit
    arithmetic, (id ^ key_hi) * TOKEN_MUL + key_lo, then murmur3's fmix32 (a bijection: a row's
    tokens get distinct hashes). 23 hash bits make a uniform u in (0, 1) exactly representable
    in float32 (``race_uniform``); the noise is -log(u). (32-bit work per token: the GPU twin
    is cheap.)"""
    return -torch.log(race_uniform(seeds, counters, vocab))


def race_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniform u [rows, vocab] of ``race_noise`` (exact float32 values)."""
    key = race_row_keys(seeds, counters)
    key_lo, key_hi = (key & _LOW32)[:, None], _srl(key, 32)[:, None]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    x = (((v ^ key_hi) * TOKEN_MUL) + key_lo) & _LOW32
    x = x ^ (x >> 16)
    x = (x * FMIX1) & _LOW32
    x = x ^ (x >> 13)
    x = (x * FMIX2) & _LOW32
    x = x ^ (x >> 16)
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def race(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(logits / t - log noise) per row (argmax(logits) where t is 0): with Exp(1) noise
    a draw from softmax(logits / t) (the exponential race)."""
    x = logits.float()
    t = temperature.float()[:, None]
    noisy = x / torch.where(t > 0, t, 1.0) - torch.log(noise)
    return torch.where(t > 0, noisy, x).argmax(-1)


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor) -> torch.Tensor:
    """Token ids [rows] drawn from softmax(logits / temperature) by the exponential race with
    the hashed noise of ``race_noise``; a row with temperature 0 takes argmax(logits) (greedy).
    logits: [rows, vocab], any float dtype (-inf masks a token); temperature float32,
    seeds/counters int64, all [rows]."""
    return race(logits, temperature, race_noise(seeds, counters, logits.shape[1]))


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies whole KV blocks src[i] -> dst[i] in every layer's cache (copy on write)."""
    for cache in kv_caches:
        if cache.dtype == torch.float8_e4m3fn:   # float8 index_put is not on every device
            cache = cache.view(torch.uint8)
        cache[:, dst] = cache[:, src]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        mask_of: torch.Tensor | None = None) -> None:
    """Structured outputs: in place, ``logits[rows[k], t] = -inf`` for every token ``t`` whose
    bit is clear in ``bitmask[k]`` (int32 words, bit ``t % 32`` of word ``t // 32``); with
    ``mask_of``, in ``bitmask[mask_of[k]]``, and rows whose ``mask_of`` is negative are left
    alone."""
    if mask_of is not None:
        keep = mask_of >= 0
        rows, bitmask = rows[keep], bitmask[mask_of[keep].long()]
    if rows.numel() == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    allowed = allowed[:, :logits.shape[1]].to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
