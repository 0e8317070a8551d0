"""The Triton kernels against their torch references in ``headrace.kernels.reference``, on random
data.

On a CUDA machine they run compiled on the GPU; elsewhere under Triton's CPU interpreter, which
this module switches on (TRITON_INTERPRET=1) before triton is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import triton_attention, triton_decode, triton_ops  # noqa: E402
import headrace.kernels.reference as ref  # noqa: E402
from headrace.dataplane.rotary import cos_sin_cache  # noqa: E402

def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(DEVICE)


def _close(actual, expected, **tol):
    """assert_close, by default with torch's tolerances for the dtype, widened to a few ulps for
    bfloat16: the interpreter truncates float32 -> bfloat16 casts (the GPU rounds to nearest)."""
    if not tol and expected.dtype == torch.bfloat16:
        tol = dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **tol)


# --------------------------------------------------------------------------- row-wise ops

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norms(dtype):
    torch.manual_seed(0)
    x, r, w = _randn(7, 96, dtype=dtype), _randn(7, 96, dtype=dtype), _randn(96, dtype=dtype)
    _close(triton_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    normed, residual = triton_ops.fused_add_rms_norm(x, r, w, 1e-6)
    expect_normed, expect_residual = ref.fused_add_rms_norm(x, r, w, 1e-6)
    _close(residual, expect_residual)
    _close(normed, expect_normed)
    # q/k norm: per-head rows of a strided [tokens, heads, head_dim] view; float32 weight.
    qkv = _randn(5, 3 * 4 * 64, dtype=dtype)
    q = qkv[:, :256].view(5, 4, 64)
    w32 = _randn(64)
    normed = triton_ops.rms_norm(q, w32, 1e-5)
    assert normed.dtype == torch.float32
    _close(normed.to(dtype), ref.rms_norm(q, w32, 1e-5).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    gate_up = _randn(6, 2 * 1100, dtype=dtype)  # d = 1100 spans two column blocks
    _close(triton_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    batched = _randn(2, 3, 2 * 40, dtype=dtype)
    _close(triton_ops.silu_and_mul(batched), ref.silu_and_mul(batched))


# --------------------------------------------------------------------------- paged attention

def _paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype):
    """Random queries and a paged cache holding each sequence's context in shuffled blocks;
    every slot that is not part of some context (tails of last blocks, spare blocks) is NaN."""
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 2
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks).tolist()
    width = max(-(-c // block_size) for c in ctx_lens) + 1
    tables = []
    for ctx in ctx_lens:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])
        kv = torch.randn(2, ctx, kv_heads, head_dim).to(dtype)
        ref.write_kv(cache, kv[0], kv[1], slots)
        tables.append(table + [0] * (width - len(table)))
    query = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (query, cache, starts, torch.tensor(ctx_lens, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32))


def _check_attention(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, **hints):
    torch.manual_seed(0)
    args = _paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    expect = ref.paged_attention(*args, scale)
    actual = triton_attention.paged_attention(*(a.to(DEVICE) for a in args), scale, **hints)
    assert not actual.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _close(actual, expect, atol=tol, rtol=tol)


# (heads, kv_heads, head_dim, block_size, dtype): GQA 1/4/8, head_dim 32/64/128, blocks 16/32.
LAYOUTS = [
    (4, 4, 64, 16, torch.bfloat16),
    (8, 2, 128, 32, torch.float16),
    (8, 1, 128, 16, torch.bfloat16),
    (8, 1, 128, 32, torch.float32),
    (2, 1, 32, 16, torch.float16),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS)
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_attention(heads, kv_heads, head_dim, block_size, dtype, splits):
    # Ragged contexts: length 1, an exact multiple of the block size, and longer than one
    # 64-key tile per split; 4 splits of a 1-token context leave three splits empty.
    ctx_lens = [1, 2 * block_size, 45, 300]
    _check_attention([1] * 4, ctx_lens, heads, kv_heads, head_dim, block_size, dtype,
                     decode_only=True, num_kv_splits=splits)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS[:3])
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_attention_in_a_start_order(heads, kv_heads, head_dim, block_size, dtype, splits):
    # A start order (any permutation; the engine passes longest context first) only schedules
    # programs: the same output per row.
    ctx_lens = [45, 1, 300, 2 * block_size, 7]
    order = torch.tensor([2, 0, 3, 4, 1], dtype=torch.int32, device=DEVICE)
    _check_attention([1] * 5, ctx_lens, heads, kv_heads, head_dim, block_size, dtype,
                     decode_only=True, num_kv_splits=splits, decode_order=order)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS)
def test_mixed_attention(heads, kv_heads, head_dim, block_size, dtype):
    # A fresh prompt, chunked prefills over a cached prefix (the first starts right after a full
    # 64-key tile, the second's tile spans the causal diagonal), decodes of an exact multiple of
    # the block size and of length 1.
    q_lens, ctx_lens = [21, 4, 30, 1, 1], [21, 67, 130, 2 * block_size, 1]
    _check_attention(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype,
                     max_query_len=30)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS[:3])
@pytest.mark.parametrize("splits", [None, 2])
def test_mixed_attention_with_leading_decodes(heads, kv_heads, head_dim, block_size, dtype, splits):
    # Three one-token rows first (one a prefill chunk of a single token, mid-prompt) go through
    # the decode kernel; the prefill rows after them keep absolute query offsets.
    q_lens, ctx_lens = [1, 1, 1, 21, 30, 4], [1, 2 * block_size + 3, 70, 21, 130, 67]
    _check_attention(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype,
                     max_query_len=30, num_decodes=3, num_kv_splits=splits,
                     decode_order=torch.tensor([1, 2, 0], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", LAYOUTS[:4])
def test_verify_tokens_as_decode_rows(heads, kv_heads, head_dim, block_size, dtype):
    """A speculative verify replayed in the decode graphs (``spec_decode.decode_rows``): each of
    a sequence's 1 + d tokens is a decode row whose context ends at it, over the sequence's
    block table; the decode kernel then gives the causal multi-token attention."""
    torch.manual_seed(0)
    q_lens, ctx_lens = [5, 1, 3], [70, 2 * block_size, 9]
    query, cache, starts, seq_lens, tables = _paged_batch(q_lens, ctx_lens, heads, kv_heads,
                                                          head_dim, block_size, dtype)
    expect = ref.paged_attention(query, cache, starts, seq_lens, tables, head_dim ** -0.5)
    row_lens = torch.cat([torch.arange(c - q + 1, c + 1) for q, c in zip(q_lens, ctx_lens)])
    rows = [t.to(DEVICE) for t in (torch.arange(len(row_lens) + 1, dtype=torch.int32),
                                    row_lens.to(torch.int32), tables.repeat_interleave(torch.tensor(q_lens), 0))]
    order = torch.argsort(-row_lens, stable=True).to(torch.int32).to(DEVICE)
    actual = triton_attention.paged_attention(query.to(DEVICE), cache.to(DEVICE), *rows, head_dim ** -0.5,
                                              decode_only=True, decode_order=order)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _close(actual, expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [None, 4])
def test_attention_writes_into_a_given_output(splits):
    """``out=``: the piecewise CUDA graphs' static attention buffer, written by the decode and
    prefill kernels of a mixed step (rows beyond the step's tokens untouched)."""
    torch.manual_seed(0)
    q_lens, ctx_lens = [1, 1, 21, 30], [9, 300, 21, 130]
    query, *rest = (a.to(DEVICE) for a in _paged_batch(q_lens, ctx_lens, 8, 2, 128, 16, torch.bfloat16))
    buffer = torch.full((query.shape[0] + 5, *query.shape[1:]), 7.0, dtype=query.dtype, device=DEVICE)
    out = buffer[:query.shape[0]]
    got = triton_attention.paged_attention(query, *rest, 128 ** -0.5, max_query_len=30, num_decodes=2,
                                           num_kv_splits=splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(out, triton_attention.paged_attention(query, *rest, 128 ** -0.5, max_query_len=30,
                                                 num_decodes=2, num_kv_splits=splits))
    assert (buffer[query.shape[0]:] == 7.0).all()


def test_attention_without_hints_finds_the_path():
    _check_attention([1, 1], [40, 7], 4, 2, 64, 16, torch.bfloat16)        # decode kernel
    # Two 256-query tiles (no GQA); a tile whose first query is one short of a 64-key boundary.
    _check_attention([2, 300, 5], [9, 300, 67], 2, 2, 64, 16, torch.float16)


def test_num_decode_splits_from_shapes():
    cpu = torch.device("cpu")
    assert triton_attention.num_decode_splits(1, 8, 32768, cpu) == 1  # one "SM" on CPU
    if DEVICE == "cuda":
        gpu = torch.device(DEVICE)
        assert triton_attention.num_decode_splits(256, 8, 32768, gpu) == 1
        assert triton_attention.num_decode_splits(1, 8, 32768, gpu) > 8
        assert triton_attention.num_decode_splits(1, 8, 256, gpu) == 1


def test_num_decode_splits_on_an_h200(monkeypatch):
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    splits = {b: triton_attention.num_decode_splits(b, 8, 40960, cpu) for b in (1, 4, 32, 33, 256)}
    assert splits == {1: 32, 4: 16, 32: 4, 33: 1, 256: 1}
    assert triton_attention.num_decode_splits(1, 8, 3000, cpu) == 4   # >= 256 keys per split


def test_dispatch_resolves_from_environment():
    """HEADRACE_KERNELS=triton sends CPU tensors to the Triton ops (here under the interpreter);
    the default keeps this process's CPU tensors on the reference."""
    x, w = torch.randn(3, 32), torch.randn(32)
    from headrace import kernels

    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6),
                               atol=0, rtol=0)
    code = ("from headrace import kernels; import headrace.kernels.triton_ops as t, "
            "headrace.kernels.triton_attention as a;"
            "assert kernels.rms_norm is t.rms_norm and kernels.silu_and_mul is t.silu_and_mul;"
            "assert kernels._paged_attention is a.paged_attention")
    env = dict(os.environ, HEADRACE_KERNELS="triton", TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_race_draws_the_reference_tokens(dtype):
    """Same hashed noise, same winner: greedy rows, hot and cold temperatures, masked tokens,
    a vocabulary that is not a multiple of the chunk."""
    from headrace.kernels import triton_sampling
    torch.manual_seed(0)
    rows, vocab = 12, 5000
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    logits[3, 100:] = float("-inf")                     # top-k-like mask: only 100 tokens left
    temperature = torch.tensor([0.0, 0.6, 1.0, 2.0, 0.3, 0.0, 1.5, 0.9, 0.6, 0.6, 5.0, 0.05])
    seeds = torch.randint(-2**62, 2**62, (rows,))
    counters = torch.randint(0, 10_000, (rows,))
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got = triton_sampling.sample_race(dev(logits), dev(temperature), dev(seeds), dev(counters))
    want = ref.sample_race(logits, temperature, seeds, counters)
    # the GPU's log may differ from torch's in the last ulp: a near tie could flip, rarely
    assert (got.cpu() == want).sum() >= rows - 1
    assert got[0].item() == logits[0].float().argmax().item()
    assert got[3].item() < 100


@pytest.mark.parametrize("heads,kv_heads,head_dim,norm,dtype", [
    (4, 2, 64, True, torch.bfloat16), (8, 2, 128, True, torch.float32),
    (6, 6, 64, False, torch.float16), (4, 1, 128, False, torch.bfloat16)])
def test_qk_norm_rope_write_kv(heads, kv_heads, head_dim, norm, dtype):
    """The fused prologue against the reference's five ops: q out, and the cache contents
    (unwritten slots, padded tokens and strided q/k/v views of one qkv projection)."""
    from headrace.kernels import triton_prologue
    torch.manual_seed(0)
    tokens, block_size, num_blocks = 7, 4, 6
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    positions = torch.tensor([0, 5, 6, 17, 3, 9, 30]).to(DEVICE)
    slots = torch.tensor([0, 5, -1, 11, 3, 23, -1]).to(DEVICE)
    cos_sin = cos_sin_cache(head_dim, 64, 10000.0, None).to(DEVICE)
    qw = (1 + 0.1 * _randn(head_dim)).to(dtype) if norm else None
    kw = (1 + 0.1 * _randn(head_dim)).to(dtype) if norm else None
    caches = [torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
              for _ in range(2)]
    got = triton_prologue.qk_norm_rope_write_kv(q, k, v, positions, cos_sin, qw, kw, 1e-6, caches[0], slots)
    want = ref.qk_norm_rope_write_kv(q, k, v, positions, cos_sin, qw, kw, 1e-6, caches[1], slots)
    # a float16 product may land one ulp apart on the GPU (seen on the H200 in 1.5% of elements)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else {}
    _close(got, want, **tol)
    _close(caches[0], caches[1], **tol)
    assert (caches[0][:, 0, 2] == 7.0).all()   # a slot no token maps to stays as it was


@pytest.mark.parametrize("rows,n,k,bias,dtype", [(1, 96, 64, False, torch.bfloat16),
                                                 (5, 4100, 48, True, torch.float16),
                                                 (3, 6150, 40, False, torch.bfloat16),
                                                 (16, 40, 300, False, torch.float32),
                                                 (17, 32, 32, False, torch.float32),
                                                 (2, 32, 2100, False, torch.float32)])
def test_skinny_linear(rows, n, k, bias, dtype):
    """Every tile shape, column and K tails, bias; more than 16 rows and long rows fall back
    to torch's GEMM."""
    from headrace.kernels import triton_linear
    torch.manual_seed(0)
    x, w = _randn(rows, k, dtype=dtype), _randn(n, k, dtype=dtype) / k ** 0.5
    b = _randn(n, dtype=dtype) if bias else None
    got = triton_linear.linear(x, w, b)
    want = ref.linear(x.float().cpu(), w.float().cpu(), None if b is None else b.float().cpu())
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    assert triton_linear.linear(x[None], w, b).shape == (1, rows, n)
