"""The skinny W8A8 GEMM on the FP8 tensor cores (``headrace.kernels.triton_fp8_w8a8``) against the
plain-torch W8A8 semantics (``headrace.kernels.reference_quant``: rows quantised per token, the
weight per row or with one scale), and how an FP8 layer's rows reach it.

Under Triton's CPU interpreter here (TRITON_INTERPRET=1: the operands widened to float32, exact);
with HEADRACE_TEST_DEVICE=cuda (or any CUDA machine) compiled on the GPU (wgmma on e4m3).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import quant_dispatch, skinny_gemm, triton_fp8_w8a8, triton_quant  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402
from tests.test_fp8_skinny import _case as fp8_case  # noqa: E402



def _case(m, n, k, per_tensor, bias, seed):
    """test_fp8_skinny's weight, scale and bias; its rows quantised per token."""
    x, wq, scale, b = fp8_case(m, n, k, torch.bfloat16, per_tensor, bias, seed)
    xq, sx = ref.per_token_fp8(x.float() * 1.5)
    return xq, sx, wq, scale, b


def _expect(xq, sx, wq, scale, b):
    """(xq sx) (wq s)^T + b in float32: the W8A8 product the kernel rounds once to bfloat16."""
    y = (xq.float() * sx.reshape(-1, 1)) @ (wq.float() * scale.reshape(-1, 1)).t()
    return y + b.float() if b is not None else y


# (m, n, k, tile): the fixed tile, K split 2 and 3 ways (a ragged last slice: the self-cleaning
# workspace), N and K ragged against the tile (masked loads, clamped columns), rows past M in a
# tile (clamped, never stored), more rows than a tile
CASES = [(1, 64, 128, None), (5, 96, 160, Tile(16, 64, 32, 4, 3, 2)),
         (16, 128, 256, Tile(16, 64, 64, 4, 3, 3)), (3, 72, 96, Tile(16, 64, 32)),
         (40, 64, 128, Tile(32, 64, 64, 4, 3, 2)), (17, 64, 64, None)]


@pytest.mark.parametrize("m,n,k,tile", CASES, ids=[str(c[:3]) for c in CASES])
@pytest.mark.parametrize("per_tensor,bias", [(False, True), (True, False)])
def test_w8a8_matches_the_reference(poisoned, m, n, k, tile, per_tensor, bias):
    xq, sx, wq, scale, b = _case(m, n, k, per_tensor, bias, m * 100 + n + k)
    got = triton_fp8_w8a8.w8a8_linear(*(t.to(DEVICE) for t in (xq, sx, wq, scale)),
                                      None if b is None else b.to(DEVICE), tile=tile)
    want = _expect(xq, sx, wq, scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n) and not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()     # the split-K workspace cleaned itself


def test_fp8_linear_runs_w8a8_on_rows_and_on_float_input():
    """fp8_linear with kernel 'fp8_w8a8': rows already quantised (Fp8Rows, as the norm and SiLU
    kernels hand them) and float rows (quantised per token first) give the W8A8 reference."""
    xq, sx, wq, scale, b = _case(6, 64, 128, False, True, 3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (wq, scale, b)]
    rows = ref.Fp8Rows(xq.to(DEVICE), sx.to(DEVICE), torch.bfloat16)
    got = triton_quant.fp8_linear(rows, dev[0], dev[1], None, dev[2], kernel="fp8_w8a8")
    want = _expect(xq, sx, wq, scale, b)
    torch.testing.assert_close(got.cpu().float(), want, atol=1e-2 * want.abs().max().item(),
                               rtol=1e-2)
    got_x = triton_quant.fp8_linear(x.to(DEVICE), *dev[:2], None, dev[2], kernel="fp8_w8a8")
    want_x = ref.fp8_linear(x.float(), wq, scale, None, b.float())
    assert got_x.dtype == torch.bfloat16
    torch.testing.assert_close(got_x.cpu().float(), want_x,
                               atol=2e-2 * want_x.abs().max().item(), rtol=2e-2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        triton_quant.fp8_linear(rows, dev[0], dev[1], kernel="cublas")


def test_w8a8_refuses_mismatched_scales():
    xq, sx, wq, scale, _ = _case(4, 64, 128, False, False, 5)
    with pytest.raises(ValueError, match="scales"):
        triton_fp8_w8a8.w8a8_linear(xq.to(DEVICE), sx[:3].to(DEVICE), wq.to(DEVICE),
                                    scale.to(DEVICE))
    with pytest.raises(ValueError, match="columns"):
        triton_fp8_w8a8.w8a8_linear(xq.to(DEVICE), sx.to(DEVICE), wq[:, :64].to(DEVICE),
                                    scale.to(DEVICE))


def test_w8a8_is_a_dispatch_choice_with_its_own_pinned_tiles(tmp_path):
    """The table may rank fp8_w8a8 for FP8 layers and pin its tiles under their own key."""
    assert "fp8_w8a8" in quant_dispatch.KERNELS["fp8"]
    table = tmp_path / "t.json"
    table.write_text('{"rankings": {"fp8": {"64x128": {"1": ["fp8_skinny"], "16": ["fp8_w8a8", "fp8_skinny"]}}},'
                     ' "tiles": {"fp8_w8a8": {"64x128": {"16": [16, 64, 128, 4, 4, 2, 1]}}}}')
    assert quant_dispatch.load_tiles(table)["fp8_w8a8"]["64x128"]["16"][5] == 2
    plan = quant_dispatch.plan("fp8", 64, 128, "auto", lambda name: False,
                               rankings=quant_dispatch.load_table(table))
    assert plan.kernel(16) == plan.kernel(9) == "fp8_w8a8" and plan.kernel(1) == "fp8_skinny"
    for bucket in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,):
        assert all(t.dot and t.block_n >= 64 for t in triton_fp8_w8a8.TILES[bucket])
