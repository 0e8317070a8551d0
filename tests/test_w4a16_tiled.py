"""The W4A16 GEMM on the tiled INT4 layout (``headrace.kernels.triton_w4a16_tiled``): its repacking
against the GPTQ words, and its products against the plain-torch reference
(``headrace.kernels.reference_quant.wna16_linear``) over tiles, row counts, dtypes, groups and act
order.

Under Triton's CPU interpreter here (Triton's own unpacking); with HEADRACE_TEST_DEVICE=cuda (or
any CUDA machine) compiled on the GPU, where the unpacking is PTX.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import quant_dispatch, skinny_gemm, triton_w4a16_tiled as tiled  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402
from tests.test_w4a16_skinny import _layer, _tol  # noqa: E402


def test_pack_tiled_puts_each_fragment_value_where_the_layout_says():
    """Word (nb, kb, g, t), nibble 4p + 2h + r holds row 16 nb + 8 r + g at K value
    16 kb + 8 h + 2 t + p: every value once."""
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1))
    words = tiled.pack_tiled(ref.pack_along_k(q.to(torch.uint8), 4))
    assert words.shape == (n // 16, k // 16, 8, 4) and words.dtype == torch.int32
    for nb, kb, g, t, p, h, r in [(0, 0, 0, 0, 0, 0, 0), (1, 15, 7, 3, 1, 1, 1),
                                  (1, 3, 2, 1, 0, 1, 0), (0, 9, 5, 2, 1, 0, 1)]:
        nibble = (int(words[nb, kb, g, t]) >> (4 * (4 * p + 2 * h + r))) & 0xF
        assert nibble == int(q[16 * nb + 8 * r + g, 16 * kb + 8 * h + 2 * t + p])


# (rows, n, k, group, tile): the fixed tile; K split 2 and 3 ways (a ragged slice: the
# workspace); N not in whole tiles (blocks clamped); rows past M; more rows than a tile; one
# group for all of K; groups of 256
CASES = [(1, 64, 256, 128, None), (5, 96, 384, 128, Tile(16, 64, 128, 4, 3, 2)),
         (16, 128, 640, 128, Tile(16, 64, 128, 4, 3, 3)), (3, 80, 256, 128, Tile(16, 64, 128)),
         (40, 64, 256, 128, Tile(32, 64, 128, 4, 3, 2)), (17, 64, 256, 256, None),
         (6, 64, 512, 512, Tile(16, 128, 128, 8, 3, 2))]


@pytest.mark.parametrize("m,n,k,group,tile", CASES, ids=[str(c[:4]) for c in CASES])
@pytest.mark.parametrize("dtype,act_order,bias", [(torch.bfloat16, False, True),
                                                  (torch.float16, True, False),
                                                  (torch.float32, False, False)])
def test_tiled_matches_the_reference(poisoned, m, n, k, group, tile, dtype, act_order, bias):
    qweight, scales, zeros, g_idx, perm = _layer(n, k, 4, group, act_order, m * 7 + n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = tiled.w4a16_tiled_linear(
        x.to(DEVICE), tiled.pack_tiled(qweight).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
        group, None if perm is None else perm.to(DEVICE), None if b is None else b.to(DEVICE),
        tile=tile)
    want = ref.wna16_linear(x.float(), qweight, scales, zeros, g_idx, perm, 4, group,
                            None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n) and not got.isnan().any()
    torch.testing.assert_close(got.cpu().float(), want.float(), **_tol(want, dtype))
    ws, counters = skinny_gemm.WORKSPACE.buffers[got.device]
    assert not ws.any() and not counters.any()     # the split-K workspace cleaned itself


def test_what_it_takes_and_refuses():
    assert tiled.supports(4, 128, 4096, 4096) and tiled.supports(4, 4096, 64, 256)
    assert not tiled.supports(8, 128, 4096, 4096)        # 4-bit only
    assert not tiled.supports(4, 128, 4104, 4096)        # N in blocks of 16
    assert not tiled.supports(4, 64, 4096, 4096)         # groups of a multiple of 128
    qweight, scales, zeros, _, _ = _layer(64, 256, 4, 128, False, 3)
    x = torch.randn(2, 256).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="groups of 64"):
        tiled.w4a16_tiled_linear(x, tiled.pack_tiled(qweight).to(DEVICE), scales.to(DEVICE),
                                 zeros.to(DEVICE), 64)
    with pytest.raises(ValueError, match="columns"):
        tiled.w4a16_tiled_linear(x[:, :128], tiled.pack_tiled(qweight).to(DEVICE),
                                 scales.to(DEVICE), zeros.to(DEVICE), 128)
    assert "triton_tiled" in quant_dispatch.KERNELS["w4a16"]
    assert "triton_tiled" in quant_dispatch.TILE_KEYS


def test_a_layer_plans_within_its_layout_budget(monkeypatch):
    """A layer whose table ranks the tiled kernel first makes its tiled copy under the default
    budget (one extra layout) and neither runs it nor makes the copy under a budget of none
    (HEADRACE_QUANT_LAYOUTS=0); the results match the reference either way."""
    from headrace import kernels
    from headrace.dataplane.quantization import layers
    from headrace.kernels import triton_quant
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant,
                                              "wna16_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setattr(quant_dispatch, "table", lambda: {"w4a16": {"64x256": {
        "1": ["triton_tiled"], "256": ["triton_tiled"]}}})
    qweight, scales, zeros, g_idx, _ = _layer(64, 256, 4, 128, False, 8)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want = ref.wna16_linear(x.cpu(), qweight, scales, zeros, g_idx, None, 4, 128)
    for budget, kernel in (("1", "triton_tiled"), ("0", "triton_skinny")):
        monkeypatch.setenv("HEADRACE_QUANT_LAYOUTS", budget)
        layer = layers.WNA16Linear(*(t.to(DEVICE) for t in (qweight, scales, zeros, g_idx)),
                                   None, 4, 128, None, "auto")
        got = layer(x)
        assert layer.plan.kernel(3) == kernel
        assert set(layer.prepared) == ({"triton_tiled"} if budget == "1" else set())
        torch.testing.assert_close(got.cpu(), want, **_tol(want, torch.float32))


def test_a_bad_layout_budget_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("HEADRACE_QUANT_LAYOUTS", "two")
    with pytest.raises(ValueError, match="HEADRACE_QUANT_LAYOUTS='two'"):
        quant_dispatch.resolve_backend("auto", "cpu", lambda library: None)
