"""The W4A16 / W8A16 decode GEMM (``headrace.kernels.triton_w4a16``) against the plain-torch
reference (``headrace.kernels.reference_quant.wna16_linear``), its program shapes, and which layers
it takes.

Under Triton's CPU interpreter here; with HEADRACE_TEST_DEVICE=cuda (or any CUDA machine)
compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import skinny_gemm, triton_quant, triton_w4a16  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402

DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# FMA rows 1 / 2 / 4 (one row also pipelined), swapped tl.dot, K split 2..4 (a ragged last
# slice), several tiles;
# (rows, bits, tile): 4- and 8-bit values through FMA and tl.dot programs
TILES = ((1, 4, Tile(1, 32, 128, dot=False)), (1, 4, Tile(1, 64, 128, 4, 1, 3, dot=False, pipe=True)),
         (1, 8, Tile(1, 32, 128, 2, 2, dot=False, pipe=True)),
         (2, 8, Tile(2, 16, 128, split=3, dot=False)),
         (3, 4, Tile(4, 64, 128, split=2, dot=False)), (17, 8, Tile(16, 32, 128, split=3)),
         (9, 4, Tile(16, 16, 128)), (40, 4, Tile(32, 64, 128, split=4)),
         (1, 4, Tile(16, 64, 128, split=2)),        # one row on the tensor cores
         (12, 4, Tile(16, 32, 128, 2, 3, 4)),       # below wgmma's 64: the Ampere MMA
         (16, 4, Tile(16, 64, 128, 2, 3, 4)))


def _layer(n, k, bits, group_size, act_order, seed):
    """Packed random values with their scales and zeros (float32, as the loader keeps them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    groups = -(-k // group_size)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32).to(torch.uint8)
    g_idx = (torch.arange(k) // group_size).to(torch.int32)
    perm = torch.randperm(k, generator=g) if act_order else None
    return ref.pack_along_k(q, bits), scales, zeros, g_idx, perm


def _tol(expect, dtype):
    """The kernel applies scales in float32 per tile (the reference rounds every dequantised
    weight to x's dtype), so 16-bit dtypes differ by a few of their ulps of the output scale."""
    scale = expect.float().abs().max().item()
    if dtype == torch.float32:
        return dict(atol=1e-5 * scale, rtol=1e-4)
    return dict(atol=1.5e-2 * scale, rtol=1.5e-2)


@pytest.mark.parametrize("bits,m,group_size,act_order,bias", [
    (4, 1, 128, False, True), (4, 3, 256, True, False), (4, 40, 0, False, False),
    (4, 17, 128, False, False), (8, 1, 0, False, True), (8, 17, 256, True, False)])
def test_w4a16_skinny_matches_reference(bits, m, group_size, act_order, bias):
    seed = bits * 1000 + m * 10 + group_size + act_order
    n, k = 96, 512
    group_size = group_size or k          # 0: one group per output channel
    dtype = DTYPES[seed % 3]
    qweight, scales, zeros, g_idx, perm = _layer(n, k, bits, group_size, act_order, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, perm, bits, group_size, b)
    dev = [None if t is None else t.to(DEVICE) for t in (x, qweight, scales, zeros, perm, b)]
    tol = _tol(expect, dtype)
    got = triton_w4a16.w4a16_linear(dev[0], *dev[1:5], bits, group_size, dev[5])
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.cpu(), expect, **tol)
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()


@pytest.mark.parametrize("m,bits,tile", TILES, ids=[f"{t[1]}-bit {t[2]}" for t in TILES])
def test_w4a16_skinny_every_program_shape(m, bits, tile):
    """Each program shape a bucket may run (groups of 256 over K = 512, bf16 with a bias: one
    compile a tile on the GPU); the workspace is all zeros after each."""
    qweight, scales, zeros, g_idx, _ = _layer(96, 512, bits, 256, False, m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, None, bits, 256, b)
    dev = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    got = triton_w4a16.w4a16_linear(*dev, None, bits, 256, b.to(DEVICE), tile=tile)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.bfloat16))
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()


@pytest.mark.parametrize("m,bits,k,tile", [
    (1, 4, 688, Tile(1, 32, 128, 2, 1, 2, dot=False, pipe=True)),     # K not whole steps
    (1, 8, 688, Tile(1, 64, 128, 4, 1, 3, dot=False, pipe=True)),
    (12, 4, 688, Tile(16, 32, 128, 2, 3, 2)),
    (1, 4, 512, Tile(1, 64, 128, 4, 1, 8, dot=False, pipe=True)),     # slices past K: empty
    (5, 4, 512, Tile(16, 32, 128, 2, 3, 8))], ids=str)
def test_w4a16_skinny_ragged_k_and_empty_slices(m, bits, k, tile):
    """K not a multiple of a step (one group over K: the masked loads) and more K slices than
    steps (slices past K load the last step and add nothing); 40 columns: a ragged last tile."""
    qweight, scales, zeros, g_idx, _ = _layer(40, k, bits, k, False, k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, None, bits, k)
    dev = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    got = triton_w4a16.w4a16_linear(*dev, None, bits, k, tile=tile)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.bfloat16))
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()


def test_w4a16_skinny_leading_dims():
    qweight, scales, zeros, g_idx, _ = _layer(64, 256, 4, 128, False, 3)
    x = torch.randn(2, 3, 256)
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, None, 4, 128)
    dev = [t.to(DEVICE) for t in (qweight, scales, zeros)]
    got = triton_w4a16.w4a16_linear(x.to(DEVICE), *dev, None, 4, 128)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.float32))
    assert triton_w4a16.w4a16_linear(x[:0].to(DEVICE), *dev, None, 4, 128).shape == (0, 3, 64)


def test_which_layers_the_skinny_kernel_takes():
    """Groups of a multiple of 128 columns or one group over K; not smaller groups (the general
    kernel takes them), not a per-column group index, not other bit widths."""
    assert triton_w4a16.supports(4, 128, 4096) and triton_w4a16.supports(8, 256, 4096)
    assert triton_w4a16.supports(4, 688, 688) and triton_w4a16.supports(8, 4096, 4096)
    assert not triton_w4a16.supports(4, 64, 4096) and not triton_w4a16.supports(4, 0, 4096)
    assert not triton_w4a16.supports(2, 128, 4096)
    qweight, scales, zeros, _, _ = _layer(32, 256, 4, 64, False, 1)
    with pytest.raises(ValueError, match="groups of a multiple of 128"):
        triton_w4a16.w4a16_linear(torch.randn(1, 256), qweight, scales, zeros, None, 4, 64)


def test_wna16_linear_takes_the_skinny_kernel_by_rows_and_groups(monkeypatch):
    assert triton_quant.wna16_kernel(1, 4, 128, 4096) == "triton_skinny"
    assert triton_quant.wna16_kernel(skinny_gemm.MAX_ROWS, 8, 4096, 4096) == "triton_skinny"
    assert triton_quant.wna16_kernel(skinny_gemm.MAX_ROWS + 1, 4, 128, 4096) == "triton"
    assert triton_quant.wna16_kernel(1, 4, 64, 4096) == "triton"
    calls = []
    real = triton_w4a16.w4a16_linear
    monkeypatch.setattr(triton_w4a16, "w4a16_linear",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    qweight, scales, zeros, g_idx, _ = _layer(32, 256, 4, 128, False, 2)
    dev = [t.to(DEVICE) for t in (qweight, scales, zeros, g_idx)]
    x = torch.randn(2, 256)
    expect = ref.wna16_linear(x, qweight, scales, zeros, g_idx, None, 4, 128)
    for kernel in (None, "triton"):
        got = triton_quant.wna16_linear(x.to(DEVICE), *dev, None, 4, 128, kernel=kernel)
        torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.float32))
    assert calls == [(2, 256)]
    with pytest.raises(ValueError, match="kernel must be"):
        triton_quant.wna16_linear(x.to(DEVICE), *dev, None, 4, 128, kernel="marlin")


def test_w4a16_tiles_cover_every_bucket():
    for bucket in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,):
        tiles = triton_w4a16.TILES[bucket]
        assert tiles and all(t.block_k == triton_w4a16.BLOCK_K for t in tiles)
        assert all(t.block_m >= 16 for t in tiles if t.dot)


def test_the_packed_one_row_program_needs_aligned_bfloat16_rows(monkeypatch):
    """The GPU's one-row program on bfloat16 pairs reads x's rows as 32-bit words: an x whose
    rows start at an odd element, float16 rows or 8-bit words take the float32 program, with
    the same result."""
    monkeypatch.setattr(triton_w4a16, "PACKED", True)
    wide = torch.randn(2, 258).to(torch.bfloat16)
    assert triton_w4a16._packed(wide[:, :256], 4)
    assert not triton_w4a16._packed(wide[:, 1:], 4)                 # odd start
    assert not triton_w4a16._packed(torch.randn(2, 257).to(torch.bfloat16)[:, :256], 4)  # stride
    assert not triton_w4a16._packed(wide[:, :256].half(), 4)
    assert not triton_w4a16._packed(wide[:, :256], 8)
    monkeypatch.undo()
    qweight, scales, zeros, g_idx, _ = _layer(64, 256, 4, 128, False, 5)
    x = torch.randn(1, 257, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expect = ref.wna16_linear(x[:, 1:], qweight, scales, zeros, g_idx, None, 4, 128)
    dev = [t.to(DEVICE) for t in (qweight, scales, zeros)]
    got = triton_w4a16.w4a16_linear(x.to(DEVICE)[:, 1:], *dev, None, 4, 128)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.bfloat16))
