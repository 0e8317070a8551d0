"""The quantized-linear kernels (``headrace.kernels.triton_quant``) against their plain-torch
references (``headrace.kernels.reference_quant``), on random data at small shapes.

Under Triton's CPU interpreter here (TRITON_INTERPRET=1, switched on before triton is imported);
with HEADRACE_TEST_DEVICE=cuda (or any CUDA machine) compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import triton_quant  # noqa: E402


def _fp8_close(actual_q, actual_s, expect_q, expect_s):
    """Same scales; quantised values equal up to one e4m3 step (the interpreter rounds ties
    away from zero and flushes subnormals, the GPU and torch round to nearest even)."""
    torch.testing.assert_close(actual_s.cpu(), expect_s.cpu(), rtol=1e-6, atol=0)
    a, e = actual_q.cpu().float(), expect_q.cpu().float()
    step = torch.maximum(e.abs() / 8, torch.full_like(e, 2.0 ** -9))
    assert ((a - e).abs() <= step).all(), (a - e).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
def test_per_token_fp8(dtype, static):
    torch.manual_seed(0)
    x = (torch.randn(5, 1100) * torch.tensor([0.01, 1.0, 30.0, 300.0, 1e-9])[:, None]).to(dtype)
    x = x.to(DEVICE)
    s_in = torch.tensor([0.05], device=DEVICE) if static else None
    q, s = triton_quant.per_token_fp8(x, s_in)
    eq, es = ref.per_token_fp8(x, s_in)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    _fp8_close(q, s, eq, es)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static,bias", [(False, False), (True, True)])
def test_fp8_linear(dtype, static, bias):
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.1
    wq, ws = ref.quantize_fp8_weight(w)
    x = torch.randn(3, 4, 64).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    s_in = torch.tensor([0.01]) if static else None
    expect = ref.fp8_linear(x, wq, ws, s_in, b)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, wq, ws, s_in, b)]
    actual = triton_quant.fp8_linear(*dev, kernel="scaled_mm")   # 12 rows: past the skinny one
    assert actual.shape == (3, 4, 48) and actual.dtype == dtype
    # bf16 output of _scaled_mm, and one e4m3 step of slack in the quantised inputs
    torch.testing.assert_close(actual.cpu().float(), expect.float(), atol=0.05, rtol=0.05)
    # and the quantised product is near the unquantised one (the quantiser is sane)
    dense = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    assert (actual.cpu().float() - dense).abs().max() < 0.1 * dense.abs().max()


def _random_wna16(n, k, bits, group_size, act_order, seed=0):
    """Random unsigned values, scales and zeros; act_order shuffles which columns share a group."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    gs = k if group_size <= 0 else group_size
    groups = -(-k // gs)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32).to(torch.uint8)
    g_idx = (torch.arange(k) // gs).to(torch.int32)
    perm = torch.randperm(k, generator=g) if act_order else None
    return q, scales, zeros, g_idx, perm


# (bits, m, group_size, act_order): each bit width at each row range (the general kernel's three
# tile sizes, and the skinny one where it takes the layer) and each group layout (32, 64, 128
# with act order, per channel), twice; not their full product: on the GPU each (bits, group,
# tile, dtype, bias, g_idx) is a compile of its own
WNA16_CASES = [(4, 1, 32, False), (8, 5, 128, True), (4, 40, -1, False), (8, 130, 64, False),
               (4, 130, 128, True), (8, 1, -1, False), (4, 5, 64, False), (8, 40, 32, False)]


@pytest.mark.parametrize("bits,m,group_size,act_order", WNA16_CASES)
def test_wna16_linear(bits, m, group_size, act_order):
    torch.manual_seed(0)
    n, k = 96, 256
    dtype = torch.bfloat16 if m % 2 else torch.float32
    q, scales, zeros, g_idx, perm = _random_wna16(n, k, bits, group_size, act_order)
    qweight = ref.pack_along_k(q, bits)
    assert torch.equal(ref.unpack_along_k(qweight, bits), q)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if m == 5 else None
    args = (qweight, scales.to(dtype), zeros, g_idx, perm, bits)
    expect = ref.wna16_linear(x, *args, group_size if group_size > 0 else k, bias)
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (x,) + args]
    actual = triton_quant.wna16_linear(*dev, group_size if group_size > 0 else k,
                                       None if bias is None else bias.to(DEVICE))
    # bfloat16: a few ulps of the output's scale (the interpreter truncates float32 -> bfloat16
    # casts of the dequantised weights, the GPU and torch round to nearest)
    scale = expect.float().abs().max().item()
    tol = (dict(atol=1e-2 * scale, rtol=1e-2) if dtype == torch.bfloat16
           else dict(atol=1e-5 * scale, rtol=1e-4))
    torch.testing.assert_close(actual.cpu(), expect, **tol)
    # the per-column group index path (group_size 0) gives the same result
    gathered = triton_quant.wna16_linear(*dev, 0, None if bias is None else bias.to(DEVICE))
    torch.testing.assert_close(gathered.cpu(), expect, **tol)
    # K split over programs whose float32 partial sums add atomically (bias added once), with a
    # slice length that is not a multiple of the group size and a ragged last slice
    for config in ((16, 32, 32, 4, 3), (64, 64, 64, 4, 4))[m % 2::2]:
        split = triton_quant.wna16_linear(*dev, group_size if group_size > 0 else k,
                                          None if bias is None else bias.to(DEVICE), config=config)
        torch.testing.assert_close(split.cpu(), expect, **tol)


def test_wna16_tiles_split_k_only_where_output_tiles_are_few():
    """Llama-3.1-8B's o projection at batch 64: 64 output tiles, so K splits (at most MAX_SPLIT,
    each slice two K tiles at least); at batch 1 its 128 narrow tiles and gate_up's 896 do not."""
    block_m, block_n, block_k, _, split = triton_quant._tiles(64, 4096, 4096, 4)
    assert 1 < split <= triton_quant.MAX_SPLIT and 4096 // split >= 2 * block_k
    assert triton_quant._tiles(1, 28672, 4096, 4)[4] == 1
    assert triton_quant._tiles(64, 4096, 128, 4)[4] == 1   # a short K is never split


def test_wna16_ragged_groups_read_g_idx():
    """A row-parallel act-order shard: after sorting, groups have unequal sizes."""
    torch.manual_seed(0)
    n, k, bits = 64, 96, 4
    q, scales, zeros, _, _ = _random_wna16(n, k, bits, 32, False)
    g_idx = torch.sort(torch.randint(0, 3, (k,))).values.to(torch.int32)
    qweight = ref.pack_along_k(q, bits)
    x = torch.randn(3, k)
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, None, bits, 0)
    dense = x @ ((q.float() - zeros.float()[g_idx.long()].t()) * scales[g_idx.long()].t()).t()
    torch.testing.assert_close(expect, dense, atol=1e-4, rtol=1e-4)
    dev = [a.to(DEVICE) for a in (x, qweight, scales, zeros, g_idx)]
    actual = triton_quant.wna16_linear(*dev[:5], None, bits, 0)
    torch.testing.assert_close(actual.cpu(), expect, atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------- FP8 KV cache

from headrace.kernels import reference as kref  # noqa: E402
from headrace.kernels import kv_layout, triton_attention, triton_prologue  # noqa: E402

FP8 = torch.float8_e4m3fn


def _fp8_paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, k_scale, v_scale):
    """test_kernels_triton's paged batch with its cache stored as FP8 (k / k_scale, v / v_scale; V
    transposed within each block, ``headrace.kernels.kv_layout``); every slot outside a context
    holds e4m3's largest value, 448 (an FP8 cache holds no NaN, and the kernels read a context's
    last blocks whole: any weight on those slots would show). Also returns that cache dequantised
    into float32 (token-major)."""
    from tests.test_kernels_triton import _paged_batch

    query, cache, *rest = _paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size,
                                       torch.float32)
    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    cache = ref.to_fp8((cache * 3 / scales).nan_to_num(nan=448.0))
    return (query.to(torch.bfloat16), kv_layout.store(cache), *rest), cache.float() * scales


@pytest.mark.parametrize("q_lens,ctx_lens,block_size", [
    ([1, 1, 1], [5, 70, 33], 16), ([1, 7, 20], [40, 7, 90], 16),
    ([1, 7, 20, 70], [40, 7, 90, 140], 8), ([1, 20, 70], [130, 90, 140], 128)])
def test_fp8_kv_attention(q_lens, ctx_lens, block_size):
    """Attention over an FP8 cache (k_scale 0.02, v_scale 0.05) equals attention over the
    dequantised float cache, in the reference and in the Triton kernels (decode and mixed;
    blocks smaller than, as large as and larger than the prefill kernel's 64-key tile, whose
    block-table entries it reads once a tile)."""
    torch.manual_seed(0)
    args, deq = _fp8_paged_batch(q_lens, ctx_lens, 8, 2, 64, block_size, 0.02, 0.05)
    scale = 64 ** -0.5
    expect = kref.paged_attention(args[0], deq, *args[2:], scale)
    fp8_ref = kref.paged_attention(*args, scale, k_scale=0.02, v_scale=0.05)
    torch.testing.assert_close(fp8_ref.float(), expect.float(), atol=1e-2, rtol=1e-2)
    hints = dict(decode_only=True) if max(q_lens) == 1 else dict(max_query_len=max(q_lens),
                                                                 num_decodes=1)
    actual = triton_attention.paged_attention(*(a.to(DEVICE) for a in args), scale,
                                              k_scale=0.02, v_scale=0.05, **hints)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.cpu().float(), expect.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_at_tile_edges(block_size, splits):
    """Decode over an FP8 cache (V transposed within each block and read in whole blocks, the
    last tile's keys past the context masked in the scores) with contexts below, at and past the
    decode tile's edge, in one or four KV splits (some splits empty, some whole tiles only),
    blocks smaller and larger than a tile: the attention of the dequantised cache, untouched by
    the 448s in the slots past each context."""
    torch.manual_seed(2)
    ctx_lens = [1, 63, 64, 65, 128, 300]
    args, deq = _fp8_paged_batch([1] * len(ctx_lens), ctx_lens, 8, 2, 64, block_size, 0.02, 0.05)
    scale = 64 ** -0.5
    expect = kref.paged_attention(args[0], deq, *args[2:], scale).float()
    actual = triton_attention.paged_attention(*(a.to(DEVICE) for a in args), scale, k_scale=0.02,
                                              v_scale=0.05, decode_only=True, num_kv_splits=splits)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.cpu().float(), expect, atol=3e-2, rtol=3e-2)


def test_fp8_kv_prologue_writes_scaled_e4m3():
    torch.manual_seed(0)
    tokens, heads, kv_heads, hd = 6, 4, 2, 64
    from headrace.dataplane.rotary import cos_sin_cache
    cos_sin = cos_sin_cache(hd, 256, 10000.0, None, "cpu")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd) * 4
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
    q, k, v = (t.reshape(tokens, -1, hd) for t in (q, k, v))
    positions = torch.randint(0, 256, (tokens,))
    slots = torch.tensor([3, 17, -1, 40, 41, 8])
    expect = torch.zeros(2, 4, 16, kv_heads, hd, dtype=FP8)
    actual = expect.clone().to(DEVICE)
    q_ref = kref.qk_norm_rope_write_kv(q, k, v, positions, cos_sin, None, None, 1e-6, expect,
                                       slots, k_scale=0.05, v_scale=0.1)
    dev = [t.to(DEVICE) for t in (q, k, v, positions, cos_sin)]
    q_out = triton_prologue.qk_norm_rope_write_kv(*dev, None, None, 1e-6, actual,
                                                  slots.to(DEVICE), k_scale=0.05, v_scale=0.1)
    torch.testing.assert_close(q_out.cpu(), q_ref, atol=1e-4, rtol=1e-4)
    assert expect.float().abs().max() > 100      # the scales matter: values use e4m3's range
    _fp8_close(actual.float(), torch.ones(1), expect.float(), torch.ones(1))


def test_fp8_kv_writes_store_nan_as_zero():
    """The reference's and the Triton prologue's FP8 writes store a NaN key or value as 0 (and
    +-inf saturated): an FP8 cache holds no NaN, so attention may read a block's slots past a
    context whole (``headrace.kernels.kv_layout``)."""
    torch.manual_seed(0)
    from headrace.dataplane.rotary import cos_sin_cache
    tokens, heads, kv_heads, hd = 3, 2, 2, 64
    cos_sin = cos_sin_cache(hd, 64, 10000.0, None, "cpu")
    q = torch.randn(tokens, heads, hd)
    k, v = torch.randn(tokens, kv_heads, hd), torch.randn(tokens, kv_heads, hd)
    k[0, 1, 5], v[1, 0, 7], v[2, 1, 0], k[2, 0, 3] = float("nan"), float("nan"), float("inf"), -float("inf")
    positions, slots = torch.tensor([0, 1, 2]), torch.tensor([3, 17, 40])
    expect = torch.zeros(2, 4, 16, kv_heads, hd, dtype=FP8)
    actual = expect.clone().to(DEVICE)
    kref.qk_norm_rope_write_kv(q, k, v, positions, cos_sin, None, None, 1e-6, expect, slots)
    triton_prologue.qk_norm_rope_write_kv(*(t.to(DEVICE) for t in (q, k, v, positions, cos_sin)),
                                          None, None, 1e-6, actual, slots.to(DEVICE))
    for cache in (expect, actual.cpu()):
        keys, values = cache[0].float(), kv_layout.values(cache).float()
        assert not keys.isnan().any() and not values.isnan().any()
        assert values[1, 1, 0, 7] == 0 and values[2, 8, 1, 0] == 448
    # rotary mixes the NaN key's two halves: both its rotated elements are stored as 0
    assert expect[0, 0, 3, 1, 5].float() == 0 and expect[0, 0, 3, 1, 5 + hd // 2].float() == 0
    assert actual[0, 0, 3, 1, 5].float().cpu() == 0


def test_copy_blocks_copies_fp8_caches():
    cache = ref.to_fp8(torch.randn(2, 4, 16, 2, 8) * 10).to(DEVICE)
    kref.copy_blocks([cache], torch.tensor([1, 2], device=DEVICE), torch.tensor([3, 0], device=DEVICE))
    assert torch.equal(cache[:, 3].float(), cache[:, 1].float())
    assert torch.equal(cache[:, 0].float(), cache[:, 2].float())


@pytest.mark.parametrize("compute", ["float16", "query"])
def test_fp8_kv_attention_widens_tiles_not_the_cache(monkeypatch, compute):
    """Both widenings of an FP8 cache's tiles (float16 tensor-core operands, the default, or the
    query's dtype) give the attention of the dequantised cache, and no op of the call makes a
    wider tensor the size of the cache (the kernels read e4m3 and widen each tile in registers;
    the interpreter's own copies of the arguments are bytes).
    Queries of magnitude past float16's range do not overflow (clamped before the cast)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from headrace.kernels import triton_flash
    monkeypatch.setattr(triton_flash, "FP8_COMPUTE", compute)
    torch.manual_seed(1)
    args, deq = _fp8_paged_batch([1, 1, 9], [300, 37, 120], 8, 2, 64, 16, 0.02, 0.05)
    scale = 64 ** -0.5
    expect = kref.paged_attention(args[0], deq, *args[2:], scale).float()

    class Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1:
                    Sizes.largest = max(Sizes.largest, t.numel())
            return out

    dev = [a.to(DEVICE) for a in args]
    with Sizes():
        actual = triton_attention.paged_attention(*dev, scale, k_scale=0.02, v_scale=0.05,
                                                  max_query_len=9, num_decodes=2)
    torch.testing.assert_close(actual.cpu().float(), expect, atol=3e-2, rtol=3e-2)
    assert Sizes.largest < dev[1][0].numel()      # not even K (or V) alone
    big = dev[0] * 1e6       # |q| ~ 1e6: float16 would overflow without the clamp
    out = triton_attention.paged_attention(big, *dev[1:], scale, k_scale=0.02, v_scale=0.05,
                                           max_query_len=9, num_decodes=2)
    assert torch.isfinite(out.float()).all()
