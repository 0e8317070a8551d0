"""The torch reference kernels against independent dense formulations (and transformers')."""

from __future__ import annotations

import pytest
import torch

import headrace.kernels.reference as ref
from headrace.dataplane.rotary import cos_sin_cache


def _dense_causal(q, k, v, scale):
    """q: [n, H, D] (last n of ctx positions), k/v: [ctx, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ctx, n = k.shape[0], q.shape[0]
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 16), (8, 2, 16), (8, 1, 32)])
def test_paged_attention_matches_dense_and_ignores_unwritten_slots(heads, kv_heads, block_size):
    torch.manual_seed(0)
    D, num_blocks = 32, 40
    cache = torch.full((2, num_blocks, block_size, kv_heads, D), float("nan"))
    ctx_lens, q_lens = [5, 37, 64, 1], [5, 3, 1, 1]   # a prefill, a chunk, decodes
    perm = torch.randperm(num_blocks).tolist()
    tables, dense_k, dense_v, queries = [], [], [], []
    for ctx, n in zip(ctx_lens, q_lens):
        nb = -(-ctx // block_size)
        table = [perm.pop() for _ in range(nb)]
        k, v = torch.randn(ctx, kv_heads, D), torch.randn(ctx, kv_heads, D)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        ref.write_kv(cache, k, v, slots)
        tables.append(table + [0] * (4 - nb))
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(n, heads, D))
    q = torch.cat(queries)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ref.paged_attention(q, cache, starts, torch.tensor(ctx_lens, dtype=torch.int32),
                              torch.tensor(tables, dtype=torch.int32), D ** -0.5)
    assert not out.isnan().any()
    for i in range(len(ctx_lens)):
        expect = _dense_causal(queries[i], dense_k[i], dense_v[i], D ** -0.5)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expect, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padded_slots():
    cache = torch.zeros(2, 2, 4, 1, 2)
    k, v = torch.ones(3, 1, 2), 2 * torch.ones(3, 1, 2)
    ref.write_kv(cache, k, v, torch.tensor([5, -1, 0]))
    assert cache[0, 1, 1].eq(1).all() and cache[1, 0, 0].eq(2).all()
    assert cache.count_nonzero() == 2 * 2 * 2


def test_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    D, T = 64, 10
    cos_sin = cos_sin_cache(D, 128, 10000.0, None)
    positions = torch.tensor([0, 3, 7, 8, 9, 50, 51, 100, 101, 127])
    q, k = torch.randn(T, 4, D), torch.randn(T, 2, D)
    half = cos_sin[positions]
    cos = torch.cat([half[:, :D // 2]] * 2, -1)[None]
    sin = torch.cat([half[:, D // 2:]] * 2, -1)[None]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ref.apply_rotary(q, positions, cos_sin), hq[0].transpose(0, 1))
    torch.testing.assert_close(ref.apply_rotary(k, positions, cos_sin), hk[0].transpose(0, 1))


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(head_dim=128, hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=scaling, max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    from headrace.dataplane.rotary import inverse_frequencies

    torch.testing.assert_close(inverse_frequencies(128, 500000.0, scaling), expected)


def test_norms_and_activation():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    expect = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expect)
    normed, residual = ref.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, ref.rms_norm(x + r, w, 1e-6))
    gu = torch.randn(3, 8)
    torch.testing.assert_close(ref.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :4]) * gu[:, 4:])


def test_sample_race_follows_softmax_of_logits_over_temperature():
    """The exponential race with hashed noise samples softmax(logits / t); temperature 0 is
    argmax; the draw depends only on (seed, counter)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20_000, 1)
    t = torch.full((20_000,), 0.7)
    seeds = torch.arange(20_000) * 7919
    counters = torch.zeros(20_000, dtype=torch.int64)
    toks = ref.sample_race(logits, t, seeds, counters)
    freq = torch.bincount(toks, minlength=4).float() / 20_000
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.012, rtol=0)
    assert (ref.sample_race(logits[:5], torch.zeros(5), seeds[:5], counters[:5]) == 0).all()
    again = ref.sample_race(logits[:100], t[:100], seeds[:100], counters[:100])
    assert torch.equal(again, toks[:100])
    moved = ref.sample_race(logits[:100], t[:100], seeds[:100], counters[:100] + 1)
    assert not torch.equal(moved, toks[:100])
