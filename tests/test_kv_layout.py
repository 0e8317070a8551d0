"""headrace.kernels.kv_layout: an FP8 cache stores V transposed within each block; ``values``
indexes it by token, ``store`` / ``logical`` convert, and the block size it needs is checked."""

from __future__ import annotations

import pytest
import torch

from headrace.kernels import kv_layout
from headrace.kernels import reference as ref

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_fp8_values_are_stored_transposed_within_each_block():
    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim = 5, 16, 2, 8
    token_major = (torch.randn(2, blocks, block_size, kv_heads, head_dim) * 4).to(FP8)
    cache = kv_layout.store(token_major)
    raw = cache[1].reshape(blocks, kv_heads, head_dim, block_size)     # the memory of V
    for b, s, h in [(0, 0, 0), (3, 5, 1), (4, 15, 0)]:
        assert torch.equal(_bits(raw[b, h, :, s]), _bits(token_major[1, b, s, h]))
        assert torch.equal(_bits(kv_layout.values(cache)[b, s, h]), _bits(token_major[1, b, s, h]))
    assert torch.equal(_bits(cache[0]), _bits(token_major[0]))           # keys stay token-major
    assert torch.equal(_bits(kv_layout.logical(cache)), _bits(token_major))


def test_other_dtypes_keep_the_token_major_layout():
    cache = torch.randn(2, 3, 16, 2, 8, dtype=torch.bfloat16)
    assert not kv_layout.values_transposed(torch.bfloat16)
    assert kv_layout.values(cache).data_ptr() == cache[1].data_ptr()
    assert torch.equal(kv_layout.store(cache), cache)


def test_reference_write_lands_in_the_transposed_layout():
    """write_kv through the ``values`` view writes each token's value into its block's
    [head_dim, block_size] run, and attention reads it back by token."""
    torch.manual_seed(1)
    cache = torch.zeros(2, 4, 16, 2, 8, dtype=FP8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([17, -1, 63])
    ref.write_kv(cache, key, value, slots)
    raw = cache[1].reshape(4, 2, 8, 16)
    assert torch.equal(raw[1, :, :, 1].float(), value[0].to(FP8).float())
    assert torch.equal(raw[3, :, :, 15].float(), value[2].to(FP8).float())
    written = value[[0, 2]].to(FP8).view(torch.uint8)
    assert int((raw.view(torch.uint8) != 0).sum()) == int((written != 0).sum())   # nothing else


@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_power_of_two_block_sizes_are_accepted(block_size):
    kv_layout.check_block_size(FP8, block_size)


@pytest.mark.parametrize("block_size", [0, 12, 24])
def test_an_fp8_cache_refuses_other_block_sizes(block_size):
    with pytest.raises(ValueError, match="power-of-two block size"):
        kv_layout.check_block_size(FP8, block_size)
    kv_layout.check_block_size(torch.bfloat16, block_size or 1)   # other caches: any size


def test_an_fp8_pool_starts_zeroed():
    """Attention reads the slots past a context in an FP8 cache's last blocks whole, so the pool
    must hold no NaN before anything is written (headrace.kernels.kv_layout): it starts as zeros."""
    import types

    from headrace.dataplane import kv_cache
    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    for cache in kv_cache.allocate(cfg, 4, 16, torch.float8_e4m3fn, torch.device("cpu")):
        assert cache.dtype == torch.float8_e4m3fn and cache.shape == (2, 4, 16, 2, 8)
        assert not cache.float().any()
