"""headrace.kernels.reference_invariant and headrace.kernels.batch_invariant on the CPU (``--deterministic``'s
CPU path): every row's bits independent of the batch (property tests over random batch sizes,
row positions, chunkings and neighbours), close to the plain reference; and the switch that
rebinds the kernels, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from headrace import kernels
from headrace.kernels import batch_invariant, reference as ref, reference_invariant as inv

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@FAST
@given(dtype=DTYPES, n=st.integers(1, 300), k=st.integers(1, 700), rows=st.integers(1, 90),
       seed=st.integers(0, 1 << 16), bias=st.booleans())
@example(dtype=torch.float32, n=4, k=5, rows=1, seed=0, bias=False)     # (MKL's few-column
@example(dtype=torch.float32, n=4, k=5, rows=2, seed=0, bias=False)     # path: position mattered)
@example(dtype=torch.float32, n=12, k=651, rows=2, seed=0, bias=False)
def test_a_linear_row_has_the_same_bits_alone_and_in_any_batch(dtype, n, k, rows, seed, bias):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    batch = inv.linear(x, w, b)
    pick = int(torch.randint(rows, (1,), generator=g))
    alone = inv.linear(x[pick:pick + 1], w, b)
    assert torch.equal(batch[pick], alone[0])
    # the same row among other neighbours, at another position, in a 3-D input
    others = torch.randn(rows + 5, k, generator=g).to(dtype)
    others[3] = x[pick]
    assert torch.equal(inv.linear(others.view(1, rows + 5, k), w, b)[0, 3], alone[0])
    torch.testing.assert_close(batch.float(), ref.linear(x, w, b).float(),   # (other sum orders)
                               **(dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32
                                  else dict(atol=5e-2, rtol=2e-2)))


def _paged(ctx: int, kv_heads: int, head_dim: int, dtype, g, block_size=16):
    blocks = -(-ctx // block_size) + 3
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[:blocks - 3].to(torch.int32)
    return cache, table


@FAST
@given(dtype=DTYPES, ctx=st.integers(1, 700), group=st.sampled_from([1, 2, 4]),
       cuts=st.lists(st.floats(0, 1), min_size=0, max_size=4), seed=st.integers(0, 1 << 16))
def test_an_attention_row_is_the_same_as_a_decode_and_in_any_prefill_chunk(dtype, ctx, group,
                                                                           cuts, seed):
    """Positions computed one at a time (decodes, here in one batch of many sequences) and in
    chunks of a prefill cut at random points: the same bits, row for row."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = 2, 32
    cache, table = _paged(ctx, kv_heads, head_dim, dtype, g)
    q = torch.randn(ctx, kv_heads * group, head_dim, generator=g).to(dtype)
    bounds = sorted({0, ctx, *(int(c * ctx) for c in cuts)})
    chunks = []
    for a, b in zip(bounds, bounds[1:]):
        chunks.append(inv.paged_attention(q[a:b], cache, torch.tensor([0, b - a]),
                                          torch.tensor([b]), table[None], 0.125))
    chunked = torch.cat(chunks)
    positions = sorted({0, ctx - 1, *(int(c * (ctx - 1)) for c in cuts)})
    decodes = inv.paged_attention(q[positions], cache, torch.arange(len(positions) + 1),
                                  torch.tensor([p + 1 for p in positions]),
                                  table[None].expand(len(positions), -1), 0.125)
    assert torch.equal(chunked[positions], decodes)
    expected = ref.paged_attention(q, cache, torch.tensor([0, ctx]), torch.tensor([ctx]),
                                   table[None], 0.125)
    torch.testing.assert_close(chunked.float(), expected.float(),
                               **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def test_attention_of_a_mixed_batch_matches_each_sequence_alone():
    g = torch.Generator().manual_seed(3)
    cache, table = _paged(300, 2, 32, torch.float32, g)
    q = torch.randn(300, 4, 32, generator=g)
    alone = inv.paged_attention(q[250:300], cache, torch.tensor([0, 50]), torch.tensor([300]),
                                table[None], 0.125)
    decode = inv.paged_attention(q[99:100], cache, torch.tensor([0, 1]), torch.tensor([100]),
                                 table[None], 0.125)
    mixed = inv.paged_attention(torch.cat([q[99:100], q[250:300]]), cache, torch.tensor([0, 1, 51]),
                                torch.tensor([100, 300]), table[None].expand(2, -1), 0.125)
    assert torch.equal(mixed[0], decode[0]) and torch.equal(mixed[1:], alone)


@pytest.mark.parametrize("rows", [1, 2, 7, 48, 51, 150])
def test_silu_and_mul_rows_are_the_same_at_any_batch_size_even_across_threads(rows):
    """torch's CPU SiLU rounds an element by where it falls in its loop (vector body, scalar
    tail, the thread split of loops of >= 32,768 elements): 150 rows of 688 split inside row
    75 on two threads. The invariant one gives every row the bits it has alone."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(150, 2 * 688, generator=g)
    full = inv.silu_and_mul(x)
    assert torch.equal(inv.silu_and_mul(x[:rows]), full[:rows])
    assert torch.equal(inv.silu_and_mul(x[rows - 1:rows])[0], full[rows - 1])
    torch.testing.assert_close(full, ref.silu_and_mul(x))


@given(rows=st.integers(1, 40), vocab=st.integers(2, 3000), seed=st.integers(0, 1 << 30))
@FAST
def test_race_noise_and_draw_of_a_row_do_not_depend_on_the_batch(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(1 << 62), 1 << 62, (rows,), generator=g)
    counters = torch.randint(0, 1000, (rows,), generator=g)
    noise = inv.race_noise(seeds, counters, vocab)
    torch.testing.assert_close(noise, ref.race_noise(seeds, counters, vocab))
    last = inv.race_noise(seeds[-1:], counters[-1:], vocab)
    assert torch.equal(noise[-1], last[0])
    logits = torch.randn(rows, vocab, generator=g)
    temperature = torch.rand(rows, generator=g)
    tokens = inv.race(logits, temperature, noise)
    assert int(tokens[-1]) == int(inv.race(logits[-1:], temperature[-1:], last)[0])


def test_the_switch_rebinds_the_kernels_and_restores_them():
    before = {name: getattr(kernels, name) for name in batch_invariant.NAMES}
    assert not batch_invariant.ENABLED
    with batch_invariant.enabled():
        assert batch_invariant.ENABLED
        assert all(getattr(kernels, name) is not before[name] for name in batch_invariant.NAMES)
        x, w = torch.randn(5, 64), torch.randn(96, 64)
        assert torch.equal(kernels.linear(x, w), inv.linear(x, w))
    assert not batch_invariant.ENABLED
    assert {name: getattr(kernels, name) for name in batch_invariant.NAMES} == before


def test_quantized_weights_and_flash_attn_are_refused_with_the_flag_named():
    with pytest.raises(ValueError, match="--deterministic: quantized weights"):
        batch_invariant.check(quantization="fp8", attention_backend="auto")
    with pytest.raises(ValueError, match="--attention-backend flash-attn"):
        batch_invariant.check(quantization=None, attention_backend="flash-attn")
    batch_invariant.check(quantization=None, attention_backend="auto")
