"""The batch-invariant Triton kernels (``--deterministic``): the GEMM and the paged attention
give every row the same bits alone and in any batch, chunking or launch (split or folded K
slices; decode split over programs, prefill tile, unified launch, mixed step), and stay close
to the plain reference.

On a CUDA machine (HEADRACE_TEST_DEVICE=cuda) at the real models' shapes in bfloat16 (and an
FP8 KV cache); elsewhere under Triton's CPU interpreter on small shapes."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported
from headrace.kernels import reference as ref  # noqa: E402
from headrace.kernels import triton_invariant_attention as attn  # noqa: E402
from headrace.kernels import triton_invariant_tile  # noqa: E402
from headrace.kernels import triton_invariant_gemm as gemm  # noqa: E402

CUDA = DEVICE == "cuda"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _randn(*shape, g, dtype=DTYPE, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------- GEMM

# (n, k) and a forced tile: on the interpreter small tiles with several K slices
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)] if CUDA \
    else [(48, 200), (40, 96)]
TILE = None if CUDA else gemm.Tile(16, 16, 16, 4, 2, 64)
ROWS = (1, 3, 16, 64, 65, 200, 2048) if CUDA else (1, 3, 17)


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_rows_have_the_same_bits_at_every_batch_size(n, k):
    g = torch.Generator().manual_seed(n + k)
    w, b = _randn(n, k, g=g, scale=0.05), _randn(n, g=g)
    biggest = max(ROWS)
    x = _randn(biggest, k, g=g)
    full = gemm.linear(x, w, b, tile=TILE)
    for m in ROWS:
        idx = torch.randperm(biggest, generator=g)[:m].to(DEVICE)
        assert torch.equal(gemm.linear(x[idx], w, b, tile=TILE), full[idx]), f"{m} rows"
    expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(full.float(), expected, atol=3e-2 if CUDA else 1e-4,
                               rtol=2e-2 if CUDA else 1e-4)


@pytest.mark.skipif(not CUDA, reason="the row tiles are the GPU's (the interpreter keeps one tile)")
@pytest.mark.parametrize("n,k", SHAPES)
def test_row_tiles_keep_every_rows_bits(n, k, monkeypatch):
    """The H100 probe's per-row-count tiles (``HOPPER_ROW_TILES``): every row the same bits at
    every batch size, and the bits of the shape's one tile (what ``ROW_TILES`` serves once this
    passes on the GPU)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setitem(gemm.ROW_TILES, sms, gemm.HOPPER_ROW_TILES)
    g = torch.Generator().manual_seed(3 * n + k)
    w, b = _randn(n, k, g=g, scale=0.05), _randn(n, g=g)
    biggest = max(ROWS)
    x = _randn(biggest, k, g=g)
    full = gemm.linear(x, w, b)
    assert torch.equal(full, gemm.linear(x, w, b, tile=gemm.tile_for(n, k, sms)))
    for m in ROWS:
        idx = torch.randperm(biggest, generator=g)[:m].to(DEVICE)
        assert torch.equal(gemm.linear(x[idx], w, b), full[idx]), f"{m} rows"


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_gemm_slices_split_over_programs_or_folded_give_the_same_bits(n, k):
    g = torch.Generator().manual_seed(7)
    w, x = _randn(n, k, g=g, scale=0.05), _randn(40, k, g=g)
    tile = TILE or gemm.tile_for(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    assert tile.slices(k) > 1
    split = gemm.linear(x, w, tile=tile, split=True)
    folded = gemm.linear(x, w, tile=tile, split=False)
    assert torch.equal(split, folded)
    assert torch.equal(gemm.linear(x, w, tile=tile, split=True), split)   # counters reset


def test_tile_for_slices_k_for_decode_parallelism_and_not_for_wide_outputs():
    qkv = gemm.tile_for(4096, 1024, 132)   # Qwen3-0.6B's qkv on an H100/H200
    assert qkv.block_m == 64 and qkv.slices(1024) > 1
    assert (4096 // qkv.block_n) * qkv.slices(1024) >= 132   # a decode: a program an SM at least
    assert gemm.splits(qkv, 1, 4096, 1024, 132) and gemm.splits(qkv, 16, 4096, 1024, 132)
    assert not gemm.splits(qkv, 256, 4096, 1024, 132) and not gemm.splits(qkv, 2048, 4096, 1024, 132)
    head = gemm.tile_for(151936, 1024, 132)
    assert head.slices(1024) == 1 and head.block_n == 128
    assert gemm.tile_for(1024, 200, 132).slices(200) == 1      # short K: one slice
    down = gemm.tile_for(4096, 14336, 132)
    assert down.slice_k % down.block_k == 0 and down.slice_k >= gemm.MIN_SLICE


# -------------------------------------------------------------------------------- attention

HEAD_DIM = 128 if CUDA else 32
CTX = 3000 if CUDA else 300
SPLIT = 512 if CUDA else 128


@pytest.fixture
def split_tokens(monkeypatch):
    monkeypatch.setattr(triton_invariant_tile, "SPLIT_TOKENS", SPLIT)
    return SPLIT


def _cache(g, kv_heads, block_size=16, ctx=CTX):
    blocks = -(-ctx // block_size) + 2
    cache = _randn(2, blocks, block_size, kv_heads, HEAD_DIM, g=g)
    table = torch.randperm(blocks, generator=g)[:blocks - 2].to(torch.int32).to(DEVICE)
    return cache, table


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("group", [2, 4] if CUDA else [2])
def test_attention_rows_are_the_same_as_decodes_prefill_chunks_unified_and_mixed(group,
                                                                                split_tokens):
    g = torch.Generator().manual_seed(group)
    kv_heads = 2
    cache, table = _cache(g, kv_heads)
    q = _randn(CTX, kv_heads * group, HEAD_DIM, g=g)
    scale = HEAD_DIM ** -0.5
    positions = sorted({0, 5, 63, 64, split_tokens - 1, split_tokens, split_tokens + 1,
                        2 * split_tokens + 7, CTX - 1})
    n = len(positions)
    decodes = attn.paged_attention(q[positions], cache, torch.arange(n + 1, dtype=torch.int32,
                                                                       device=DEVICE),
                                   _i32([p + 1 for p in positions]),
                                   table[None].expand(n, -1).contiguous(), scale, decode_only=True)
    cuts = [0, 1, split_tokens - 3, split_tokens + 40, CTX - 20, CTX]
    chunks = [attn.paged_attention(q[a:b], cache, _i32([0, b - a]), _i32([b]), table[None], scale)
              for a, b in zip(cuts, cuts[1:])]
    chunked = torch.cat(chunks)
    assert torch.equal(chunked[positions], decodes)
    whole = attn.paged_attention(q, cache, _i32([0, CTX]), _i32([CTX]), table[None], scale)
    assert torch.equal(whole, chunked)
    # one unified launch: a decode row first, then a chunk (the full graphs' layout)
    a, b = split_tokens - 10, split_tokens + 30
    unified = attn.unified_attention(torch.cat([q[CTX - 1:CTX], q[a:b]]), cache,
                                     _i32([0, 1, 1 + b - a]), _i32([CTX, b]),
                                     table[None].expand(2, -1).contiguous(), scale)
    assert torch.equal(unified[0], decodes[-1]) and torch.equal(unified[1:], whole[a:b])
    # a mixed step: the decode kernel for the first row, the prefill kernel for the rest
    mixed = attn.paged_attention(torch.cat([q[positions[3]:positions[3] + 1], q[a:b]]), cache,
                                 _i32([0, 1, 1 + b - a]), _i32([positions[3] + 1, b]),
                                 table[None].expand(2, -1).contiguous(), scale, num_decodes=1,
                                 max_query_len=b - a)
    assert torch.equal(mixed[0], decodes[3]) and torch.equal(mixed[1:], whole[a:b])
    expected = ref.paged_attention(q, cache, _i32([0, CTX]), _i32([CTX]), table[None], scale)
    torch.testing.assert_close(whole.float(), expected.float(), atol=2e-2 if CUDA else 1e-5,
                               rtol=2e-2 if CUDA else 1e-5)


def test_a_decode_row_has_the_same_bits_in_batches_of_any_size(split_tokens):
    """The same sequence decoded alone and among others (whose contexts change how many
    programs its splits are dealt to): the same bits."""
    g = torch.Generator().manual_seed(11)
    cache, table = _cache(g, 2)
    q = _randn(1, 4, HEAD_DIM, g=g)
    scale = HEAD_DIM ** -0.5
    alone = attn.paged_attention(q, cache, _i32([0, 1]), _i32([CTX]), table[None], scale,
                                 decode_only=True)
    for batch in ((3, 40) if not CUDA else (3, 64, 256)):
        others = _randn(batch, 4, HEAD_DIM, g=g)
        others[batch // 2] = q[0]
        lens = torch.randint(1, CTX + 1, (batch,), generator=g).to(torch.int32)
        lens[batch // 2] = CTX
        out = attn.paged_attention(others, cache, torch.arange(batch + 1, dtype=torch.int32,
                                                               device=DEVICE),
                                   lens.to(DEVICE), table[None].expand(batch, -1).contiguous(),
                                   scale, decode_only=True)
        assert torch.equal(out[batch // 2], alone[0]), f"batch {batch}"


@pytest.mark.skipif(not CUDA, reason="FP8 KV on the GPU (the interpreter has no e4m3 tl.dot)")
def test_fp8_kv_cache_rows_are_the_same_as_decodes_and_in_prefill_chunks(split_tokens):
    from headrace.kernels import kv_layout, reference
    g = torch.Generator().manual_seed(5)
    kv_heads, group, ctx = 2, 4, 1500
    blocks = -(-ctx // 16) + 2
    cache = torch.zeros((2, blocks, 16, kv_heads, HEAD_DIM), dtype=torch.float8_e4m3fn,
                        device=DEVICE)
    table = torch.randperm(blocks, generator=g)[:blocks - 2].to(torch.int32).to(DEVICE)
    k, v = _randn(ctx, kv_heads, HEAD_DIM, g=g), _randn(ctx, kv_heads, HEAD_DIM, g=g)
    slots = (table.long()[torch.arange(ctx, device=DEVICE) // 16] * 16
             + torch.arange(ctx, device=DEVICE) % 16)
    reference.write_kv(cache, k, v, slots, 0.05, 0.05)
    assert kv_layout.values_transposed(cache.dtype)
    q = _randn(ctx, kv_heads * group, HEAD_DIM, g=g)
    scale = HEAD_DIM ** -0.5
    whole = attn.paged_attention(q, cache, _i32([0, ctx]), _i32([ctx]), table[None], scale,
                                 k_scale=0.05, v_scale=0.05)
    positions = [0, 700, ctx - 1]
    decodes = attn.paged_attention(q[positions], cache, _i32([0, 1, 2, 3]),
                                   _i32([p + 1 for p in positions]),
                                   table[None].expand(3, -1).contiguous(), scale, decode_only=True,
                                   k_scale=0.05, v_scale=0.05)
    assert torch.equal(whole[positions], decodes)
