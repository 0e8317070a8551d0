"""What the skinny GEMMs share (``headrace.kernels.skinny_gemm``): row buckets, the launch tile
without timing (pinned by kernels/quant_dispatch.json, else the bucket's first tile with K split by
arithmetic), the autotuner only when asked (HEADRACE_QUANT_AUTOTUNE=1), the fixed tile inside
CUDA-graph capture, and the split-K workspace that only grows outside capture. Under Triton's CPU
interpreter here (the autotuner times one call per candidate there); compiled with
HEADRACE_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import quant_dispatch, skinny_gemm, triton_fp8_linear, triton_w4a16  # noqa: E402
from headrace.kernels.skinny_gemm import Tile, Tuner  # noqa: E402


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


class _Spy:
    """Wraps a kernel: records each launch's tile constexprs."""

    def __init__(self, kernel):
        self.kernel, self.tiles = kernel, []

    def __getitem__(self, grid):
        def launch(**kw):
            self.tiles.append(Tile(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"],
                                   kw["num_stages"], kw["SPLIT_K"], kw["USE_DOT"]))
            return self.kernel[grid](**kw)
        return launch


def test_by_default_nothing_is_timed_and_the_table_pins_tiles(monkeypatch):
    """Without HEADRACE_QUANT_AUTOTUNE no call times anything: a shape the table pins runs its
    pinned tile, another the bucket's first tile (split by split_for), each chosen once."""
    monkeypatch.setattr(skinny_gemm, "AUTOTUNE", False)
    tiles = {b: [Tile(b if b < 16 else 16, 16, 64, dot=b >= 16), Tile(1, 32, 64, dot=False)]
             for b in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,)}
    tuner = Tuner(triton_fp8_linear._fp8_skinny_kernel, tiles)
    monkeypatch.setattr(tuner, "tuned", None)                  # any autotuner call would fail
    monkeypatch.setattr(skinny_gemm, "_bench", None)
    spy = _Spy(tuner.kernel)
    monkeypatch.setattr(tuner, "kernel", spy)
    monkeypatch.setattr(triton_fp8_linear, "TUNER", tuner)
    pinned = Tile(1, 16, 32, warps=2, stages=2, split=2, dot=False)
    monkeypatch.setattr(quant_dispatch, "_TILES", {"fp8": {"64x256": {"1": pinned.as_list()}}})
    for n in (64, 64, 48):
        x, wq, ws, expect = _fp8_case(1, n=n)
        got = triton_fp8_linear.fp8_weight_linear(*(t.to(DEVICE) for t in (x, wq, ws)))
        torch.testing.assert_close(got.cpu(), expect, atol=1e-4, rtol=1e-4)
    assert spy.tiles == [pinned, pinned, Tile(1, 16, 64, split=2, dot=False)]  # 3 programs
    assert len(tuner.fixed) == 2 and not tuner.seen


def test_the_fixed_tile_splits_k_where_output_tiles_are_few():
    """split_for on Llama-3.1-8B's shapes (132 SMs): FP8 at one row, 32 columns a program, has
    192 (qkv) or 128 (o, down) programs and splits K 4 ways; gate_up's 896 do not split; 64
    rows of INT4 (64 x 128 tiles, 32 or 224 programs) split 4 ways, 128 rows only twice (the
    partial sums would outweigh half the weight's bytes); a short K is never split below two K
    steps a slice."""
    fp8 = Tile(1, 32, 256, dot=False)
    assert [skinny_gemm.split_for(fp8, 1, n, k, 132).split for n, k in
            ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [4, 4, 1, 4]
    w4 = Tile(64, 128, triton_w4a16.BLOCK_K)
    assert [skinny_gemm.split_for(w4, 64, n, 4096, 132, 4).split for n in (4096, 28672)] == [4, 4]
    assert skinny_gemm.split_for(w4, 128, 4096, 4096, 132, 4).split == 2
    one = Tile(1, 32, 128, dot=False)
    assert skinny_gemm.split_for(one, 1, 4096, 512, 132).split == 2     # 256-column slices
    assert skinny_gemm.split_for(one, 1, 4096, 256, 132).split == 1


def test_the_fp8_one_row_tile_splits_only_below_two_programs_an_sm():
    """The FP8 word-wise one-row program (8 rows of 1,024 bytes a step) measured fastest
    unsplit at Llama-3.1-8B's shapes (512-3,584 programs); its tuner splits K only where its
    programs are fewer than 2 an SM (the other tiles keep 4)."""
    from headrace.kernels import triton_fp8_linear
    tuner, pipe = triton_fp8_linear.TUNER, triton_fp8_linear.TILES[1][0]
    assert pipe.pipe and (pipe.block_n, pipe.block_k) == (8, 1024)
    assert [tuner.split(pipe, 1, n, k, 132).split for n, k in
            ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [1, 1, 1, 1]
    assert tuner.split(pipe, 1, 1024, 4096, 132).split == 2        # 128 programs
    dot = Tile(16, 64, 128)
    assert tuner.split(dot, 16, 4096, 4096, 132) == skinny_gemm.split_for(dot, 16, 4096, 4096, 132)


def test_the_int4_one_row_tile_splits_for_many_programs():
    """The INT4 one-row program (64 columns, issue-bound) splits K up to 16 ways while its
    programs are fewer than 8 an SM: 16 slices for Llama's qkv, o and down (96 or 64 column
    tiles), 4 for gate_up's 448; slices stay two steps long at least, and its dot tiles keep
    the common rule."""
    tuner, pipe = triton_w4a16.TUNER, triton_w4a16.TILES[1][0]
    assert pipe.pipe and pipe.block_n == 64
    assert [tuner.split(pipe, 1, n, k, 132, 4).split for n, k in
            ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [16, 16, 4, 16]
    assert tuner.split(pipe, 1, 4096, 1024, 132, 4).split == 4     # 256-column slices at least
    dot = triton_w4a16.TILES[16][0]
    assert tuner.split(dot, 16, 4096, 4096, 132, 4) == \
        skinny_gemm.split_for(dot, 16, 4096, 4096, 132, 4)


def test_the_tuner_times_a_buckets_tiles_once_per_shape(monkeypatch):
    """With HEADRACE_QUANT_AUTOTUNE=1, two candidates for one row: the autotuner runs (times)
    both at the first call of a shape, keeps one, and later calls of that key launch it
    without timing again."""
    monkeypatch.setattr(skinny_gemm, "AUTOTUNE", True)
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
    """With autotuning on, inside CUDA-graph capture a shape that was never tuned takes the
    fixed tile (timing would synchronise the device): the autotuner is not called."""
    monkeypatch.setattr(skinny_gemm, "AUTOTUNE", True)
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
