"""What the skinny GEMMs share (``kernels.skinny_gemm``): row buckets, the autotuner over a
bucket's tiles, the fallback inside CUDA-graph capture, and the split-K workspace that only
grows outside capture. Under Triton's CPU interpreter here (the autotuner times one call per
candidate there); compiled with HEADRACE_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()
from kernels import reference_quant as ref  # noqa: E402
from kernels import skinny_gemm, triton_fp8_linear  # noqa: E402
from kernels.skinny_gemm import Tile, Tuner  # noqa: E402


def test_row_buckets():
    assert [skinny_gemm.m_bucket(m) for m in (1, 2, 3, 5, 9, 16, 17, 33, 100, 128)] == \
        [1, 2, 4, 8, 16, 16, 32, 64, 128, 128]
    assert skinny_gemm.m_bucket(129) == skinny_gemm.m_bucket(5000) == skinny_gemm.LARGE


def test_a_tile_round_trips_through_its_triton_config():
    for tile in (Tile(1, 32, 512, 8, 4, 2, dot=False), Tile(64, 128, 128)):
        config = tile.config()
        assert config.num_warps == tile.warps and config.num_stages == tile.stages
        assert Tile.of(config) == tile


def _fp8_case(m, n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    wq, ws = ref.quantize_fp8_weight(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(m, k, generator=g)
    return x, wq, ws, ref.fp8_weight_linear(x, wq, ws)


def test_the_tuner_times_a_buckets_tiles_once_per_shape(monkeypatch):
    """Two candidates for one row: the autotuner runs (times) both at the first call of a
    shape, keeps one, and later calls of that key launch it without timing again."""
    tiles = {b: [Tile(b if b < 16 else 16, 16, 64, dot=b >= 16)]
             for b in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,)}
    tiles[1] = [Tile(1, 32, 64, dot=False), Tile(1, 16, 128, split=2, dot=False)]
    tuner = Tuner(triton_fp8_linear._fp8_skinny_kernel, tiles)
    monkeypatch.setattr(triton_fp8_linear, "TUNER", tuner)
    timed = []
    real = skinny_gemm._bench
    monkeypatch.setattr(skinny_gemm, "_bench", lambda fn, quantiles=None: timed.append(1) or
                        real(fn, quantiles))
    x, wq, ws, expect = _fp8_case(1)
    dev = [t.to(DEVICE) for t in (x, wq, ws)]
    for _ in range(2):
        got = triton_fp8_linear.fp8_weight_linear(*dev)
        torch.testing.assert_close(got.cpu(), expect, atol=1e-4, rtol=1e-4)
    assert len(timed) == 2                      # both candidates, at the first call only
    assert tuner.chosen() in tiles[1]
    assert len(tuner.seen) == 1


def test_capture_launches_the_first_tile_of_an_untuned_shape(monkeypatch):
    """Inside CUDA-graph capture a shape that was never tuned takes its bucket's first tile
    (timing would synchronise the device): the autotuner is not called."""
    tuner = triton_fp8_linear.TUNER
    x, wq, ws, expect = _fp8_case(3, n=48, k=128, seed=1)
    dev = [t.to(DEVICE) for t in (x, wq, ws)]
    triton_fp8_linear.fp8_weight_linear(*dev)          # the workspace exists for this shape
    monkeypatch.setattr(skinny_gemm, "capturing", lambda device: True)
    monkeypatch.setattr(tuner, "tuned", None)          # any autotuner call would fail
    bias = torch.randn(48)                             # a new key: (..., has_bias=True)
    got = triton_fp8_linear.fp8_weight_linear(*dev, bias.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expect + bias, atol=1e-4, rtol=1e-4)


def test_the_workspace_grows_outside_capture_only_and_keeps_old_buffers(monkeypatch):
    space = skinny_gemm.Workspace()
    dev = torch.device(DEVICE)
    ws, cnt = space.get(dev, 100, 10)
    assert ws.numel() == 100 and cnt.numel() == 10 and not ws.any()
    assert space.get(dev, 50, 5)[0] is ws                   # big enough: the same buffer
    bigger, _ = space.get(dev, 200, 10)
    assert bigger.numel() == 200 and space.retired[0][0] is ws  # graphs may still point at it
    monkeypatch.setattr(skinny_gemm, "capturing", lambda device: True)
    assert space.get(dev, 150, 10)[0] is bigger
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        space.get(dev, 400, 10)
