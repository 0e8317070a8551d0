"""The unified attention kernel (``headrace.kernels.triton_unified``: one launch for a whole mixed
batch, grid by token count) against ``headrace.kernels.reference.paged_attention``: pure decode,
pure prefill, mixed, chunks over cached prefixes, GQA and the cache layouts the other kernels take,
FP8 KV, random ragged batches, and the padding a full CUDA graph's buckets add (sequences of no
query, token rows past the real ones, which keep what they held). Compiled on a GPU, else under
Triton's CPU interpreter (small shapes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import triton_unified  # noqa: E402
import headrace.kernels.reference as ref  # noqa: E402
from tests.test_kernels_triton import LAYOUTS, _close, _paged_batch  # noqa: E402


def _check(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, pad_tokens=0,
           pad_seqs=0, block_m=None, seed=0):
    """The kernel over the batch (plus padding: ``pad_tokens`` query rows past the real ones,
    ``pad_seqs`` sequences of q_len 0) equals the reference on the real rows; padded rows of
    ``out`` keep their value."""
    torch.manual_seed(seed)
    query, cache, starts, seq_lens, tables = _paged_batch(q_lens, ctx_lens, heads, kv_heads,
                                                          head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    expect = ref.paged_attention(query, cache, starts, seq_lens, tables, scale)
    n = query.shape[0]
    padded_q = torch.cat([query, torch.randn(pad_tokens, heads, head_dim).to(dtype)])
    padded_starts = torch.cat([starts, torch.full((pad_seqs,), n, dtype=torch.int32)])
    padded_lens = torch.cat([seq_lens, torch.zeros(pad_seqs, dtype=torch.int32)])
    padded_tables = torch.cat([tables, torch.zeros((pad_seqs, tables.shape[1]), dtype=torch.int32)])
    out = torch.full_like(padded_q, 7.0).to(DEVICE)
    got = triton_unified.unified_attention(
        padded_q.to(DEVICE), cache.to(DEVICE), padded_starts.to(DEVICE), padded_lens.to(DEVICE),
        padded_tables.to(DEVICE), scale, out=out, block_m=block_m)
    assert got.data_ptr() == out.data_ptr()
    assert not out[:n].isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _close(out[:n], expect, atol=tol, rtol=tol)
    assert (out[n:] == 7.0).all()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS)
def test_mixed_batch(heads, kv_heads, head_dim, block_size, dtype):
    """Decodes (one a single-token chunk mid-prompt) first, then a prompt, a chunk over a cached
    prefix and one of a single tile's last rows: every kind in one launch."""
    _check([1, 1, 1, 21, 30, 4], [1, 2 * block_size + 3, 70, 21, 130, 67], heads, kv_heads,
           head_dim, block_size, dtype)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS[:3])
def test_pure_decode_and_pure_prefill(heads, kv_heads, head_dim, block_size, dtype):
    _check([1] * 5, [1, 17, 64, 65, 200], heads, kv_heads, head_dim, block_size, dtype)
    _check([40, 3, 17], [40, 3, 17], heads, kv_heads, head_dim, block_size, dtype)


def test_chunked_prefill_over_a_long_cached_prefix():
    """A chunk whose tiles straddle key-tile boundaries (positions 183..230 of 231)."""
    _check([48], [231], 8, 2, 64, 16, torch.float16)
    _check([1, 48, 9], [300, 231, 64], 4, 4, 64, 16, torch.bfloat16, block_m=16)


@pytest.mark.parametrize("pad_tokens,pad_seqs", [(0, 3), (5, 0), (11, 6)])
def test_bucket_padding_is_neither_read_nor_written(pad_tokens, pad_seqs):
    """A graph's bucket: more token rows and sequences than the step has; the padded sequences
    have no query, the padded rows of ``out`` keep their value, the real ones are exact."""
    _check([1, 1, 13, 2], [9, 40, 30, 50], 8, 2, 64, 16, torch.bfloat16, pad_tokens, pad_seqs)


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_tile_sizes(block_m):
    """Every tile size the bench sweeps gives the same attention (fp16: 128 rows allowed)."""
    _check([1, 1, 37, 5], [33, 8, 80, 5], 8, 2, 64, 16, torch.float16, pad_tokens=3, pad_seqs=2,
           block_m=block_m)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(0, 40)), min_size=1, max_size=6),
       st.integers(0, 6), st.integers(0, 3), st.sampled_from([16, 32, 64]))
def test_random_ragged_batches(seqs, pad_tokens, pad_seqs, block_m):
    """Random (q_len, cached prefix) batches, decodes first as the runner orders them."""
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q_lens = [q for q, _ in seqs]
    ctx_lens = [q + c for q, c in seqs]
    _check(q_lens, ctx_lens, 4, 2, 32, 16, torch.float16, pad_tokens, pad_seqs, block_m)


def test_num_programs_cover_every_query_block():
    """Sequence i's blocks start at qsl[i] // BLOCK_Q + i; the grid reaches the last one's end
    for any split of the tokens, with padded sequences after them."""
    for block_q in (1, 2, 8, 32):
        for q_lens in ([1] * 9, [9], [3, 1, 7, 31], [block_q] * 4, [block_q + 1, block_q - 1 or 1]):
            starts = [0]
            for q in q_lens:
                starts.append(starts[-1] + q)
            tokens = starts[-1] + 3   # a padded bucket
            last = len(q_lens) - 1
            need = starts[last] // block_q + last + -(-q_lens[last] // block_q)
            assert triton_unified.num_programs(tokens, len(q_lens) + 5, block_q) >= need


def test_fp8_kv_cache():
    """An FP8 cache (k_scale 0.02, v_scale 0.05): the attention of the dequantised cache."""
    from headrace.kernels import kv_layout, reference_quant

    torch.manual_seed(0)
    q_lens, ctx_lens = [1, 1, 7, 20], [40, 5, 7, 90]
    query, cache, starts, seq_lens, tables = _paged_batch(q_lens, ctx_lens, 8, 2, 64, 16, torch.float32)
    scales = torch.tensor([0.02, 0.05]).view(2, 1, 1, 1, 1)
    fp8 = reference_quant.to_fp8(cache * 3 / scales)
    expect = ref.paged_attention(query, fp8.float() * scales, starts, seq_lens, tables, 64 ** -0.5)
    got = triton_unified.unified_attention(
        *(t.to(DEVICE) for t in (query.to(torch.bfloat16), kv_layout.store(fp8), starts, seq_lens,
                                  tables)),
        64 ** -0.5, k_scale=0.02, v_scale=0.05)
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), expect, atol=3e-2, rtol=3e-2)
