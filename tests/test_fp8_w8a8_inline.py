"""The W8A8 GEMM that quantises its own rows (``headrace.kernels.triton_fp8_w8a8_inline``) against
the plain-torch semantics (``headrace.kernels.reference_quant.fp8_group_linear``: x rounded to e4m3
per token and 128 columns), and its place among an FP8 layer's kernels.

Under Triton's CPU interpreter here (TRITON_INTERPRET=1: the e4m3 operands widened to float32,
exact); with HEADRACE_TEST_DEVICE=cuda (or any CUDA machine) compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import quant_dispatch, skinny_gemm, triton_fp8_w8a8_inline, triton_quant  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402
from tests.test_fp8_skinny import _case  # noqa: E402


def _outliers(x: torch.Tensor, value: float = 40.0) -> torch.Tensor:
    """x with one large value in its first 128-column group of each row: a per-token scale
    rounds the other groups as coarsely as that group, a per-group one does not."""
    x = x.clone()
    x[:, 3] = value
    return x


# (m, n, k, tile): the fixed tile; K split 2 and 3 ways (a ragged last slice, the workspace);
# N and K ragged against the tile (a short last group); rows past M in a tile; more rows than
# a tile; mma.sync's narrow tiles
CASES = [(1, 64, 256, None), (5, 96, 384, Tile(16, 64, 128, 4, 3, 2)),
         (16, 128, 640, Tile(16, 64, 128, 4, 3, 3)), (3, 72, 200, Tile(16, 64, 128)),
         (40, 64, 256, Tile(32, 64, 128, 4, 3, 2)), (17, 64, 128, None),
         (6, 64, 256, Tile(16, 32, 128, 4, 4)), (9, 48, 256, Tile(16, 16, 128, 2, 4))]


@pytest.mark.parametrize("m,n,k,tile", CASES, ids=[str(c[:3]) for c in CASES])
@pytest.mark.parametrize("dtype,per_tensor,bias", [(torch.bfloat16, False, True),
                                                   (torch.float16, True, False)])
def test_inline_w8a8_matches_the_group_reference(poisoned, m, n, k, tile, dtype, per_tensor,
                                                 bias):
    x, wq, scale, b = _case(m, n, k, dtype, per_tensor, bias, m * 100 + n + k)
    x = _outliers(x)
    got = triton_fp8_w8a8_inline.w8a8_inline_linear(
        x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE), None if b is None else b.to(DEVICE),
        tile=tile)
    want = ref.fp8_group_linear(x.float(), wq, scale, None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n) and not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()     # the split-K workspace cleaned itself


def test_group_scales_are_finer_than_a_token_scale():
    """One outlier per row, large enough that a per-token scale pushes the rest of the row into
    e4m3's subnormals: per 128 columns the other groups keep their precision, so the inline
    kernel lands nearer the unquantised product than the per-token W8A8 reference."""
    x, wq, scale, _ = _case(4, 64, 1024, torch.float32, False, False, 11)
    x = _outliers(x, 1e5)
    wq[:, 3] = 0     # the outlier's own product would hide the others' rounding
    exact = ref.fp8_weight_linear(x.float(), wq, scale)
    got = triton_fp8_w8a8_inline.w8a8_inline_linear(x.to(DEVICE), wq.to(DEVICE),
                                                    scale.to(DEVICE)).cpu().float()
    per_token = ref.fp8_linear(x.float(), wq, scale)
    assert (got - exact).abs().mean() < 0.7 * (per_token - exact).abs().mean()


def test_reference_group_quantiser():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    x[1, 130] = 1e3
    xq, sx = ref.per_group_fp8(x)
    assert xq.shape == x.shape and sx.shape == (3, 3)
    assert torch.equal(sx[1], torch.stack([x[1, g * 128:(g + 1) * 128].abs().max()
                                           for g in range(3)]) / ref.FP8_MAX)
    back = xq.float() * sx.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - x).abs() <= sx.repeat_interleave(128, dim=1)[:, :300] * 16).all()


def test_fp8_linear_runs_it_on_float_rows_and_fp8_w8a8_on_quantised_ones():
    x, wq, scale, b = _case(6, 64, 256, torch.bfloat16, False, True, 3)
    dev = [t.to(DEVICE) for t in (wq, scale, b)]
    got = triton_quant.fp8_linear(x.to(DEVICE), dev[0], dev[1], None, dev[2],
                                  kernel="fp8_w8a8_inline")
    want = ref.fp8_group_linear(x.float(), wq, scale, b.float())
    torch.testing.assert_close(got.cpu().float(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)
    rows = ref.Fp8Rows(*(t.to(DEVICE) for t in ref.per_token_fp8(x.float())), torch.bfloat16)
    got_rows = triton_quant.fp8_linear(rows, dev[0], dev[1], None, dev[2],
                                       kernel="fp8_w8a8_inline")
    want_rows = ref.fp8_rows_linear(ref.Fp8Rows(*ref.per_token_fp8(x.float()), torch.bfloat16),
                                    wq, scale, b.float())
    torch.testing.assert_close(got_rows.cpu().float(), want_rows.float(),
                               atol=1e-2 * want_rows.abs().max().item(), rtol=1e-2)
    static = torch.tensor([0.02])            # a checkpoint's static input scale: honoured
    got_static = triton_quant.fp8_linear(x.to(DEVICE), dev[0], dev[1], static.to(DEVICE),
                                         dev[2], kernel="fp8_w8a8_inline")
    want_static = ref.fp8_linear(x.float(), wq, scale, static, b.float())
    torch.testing.assert_close(got_static.cpu().float(), want_static,
                               atol=1e-2 * want_static.abs().max().item(), rtol=1e-2)


def test_inline_w8a8_refuses_bad_arguments():
    x, wq, scale, _ = _case(4, 64, 256, torch.bfloat16, False, False, 5)
    with pytest.raises(ValueError, match="columns"):
        triton_fp8_w8a8_inline.w8a8_inline_linear(x.to(DEVICE), wq[:, :128].to(DEVICE),
                                                  scale.to(DEVICE))
    with pytest.raises(ValueError, match="scales"):
        triton_fp8_w8a8_inline.w8a8_inline_linear(x.to(DEVICE), wq.to(DEVICE),
                                                  scale[:3].to(DEVICE))
    with pytest.raises(ValueError, match="BLOCK_K = 128"):
        triton_fp8_w8a8_inline.w8a8_inline_linear(x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE),
                                                  tile=Tile(16, 64, 64))


def test_it_is_a_dispatch_choice_with_its_own_tiles(tmp_path):
    assert "fp8_w8a8_inline" in quant_dispatch.KERNELS["fp8"]
    table = tmp_path / "t.json"
    table.write_text('{"rankings": {"fp8": {"64x256": {"1": ["fp8_skinny"], '
                     '"16": ["fp8_w8a8_inline"]}}}, "tiles": {"fp8_w8a8_inline": '
                     '{"64x256": {"16": [16, 32, 128, 4, 4, 1, 1]}}}}')
    assert quant_dispatch.load_tiles(table)["fp8_w8a8_inline"]["64x256"]["16"][1] == 32
    plan = quant_dispatch.plan("fp8", 64, 256, "auto", lambda name: False,
                               rankings=quant_dispatch.load_table(table))
    assert plan.kernel(12) == "fp8_w8a8_inline" and plan.kernel(1) == "fp8_skinny"
    for bucket in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,):
        assert all(t.dot and t.block_k == 128 for t in triton_fp8_w8a8_inline.TILES[bucket])


def test_a_pinned_tile_of_another_k_step_is_passed_over(monkeypatch):
    """A table pinning a 256-column step for this kernel (hand-edited: its quantiser groups 128
    columns) is not launched; the fixed tile runs and the result is still the reference's."""
    x, wq, scale, _ = _case(4, 64, 256, torch.bfloat16, False, False, 9)
    monkeypatch.setattr(quant_dispatch, "_TILES", {"fp8_w8a8_inline": {
        "64x256": {"4": [16, 64, 256, 4, 3, 1, 1]}}})
    monkeypatch.setattr(triton_fp8_w8a8_inline.TUNER, "fixed", {})
    got = triton_fp8_w8a8_inline.w8a8_inline_linear(x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE))
    assert all(t.block_k == 128 for t in triton_fp8_w8a8_inline.TUNER.fixed.values())
    want = ref.fp8_group_linear(x.float(), wq, scale)
    torch.testing.assert_close(got.cpu().float(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)
