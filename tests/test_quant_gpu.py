"""The quantized layers on a GPU (skipped without one): every kernel a layer can dispatch to
(ours and the installed libraries') against the plain-torch reference at decode and prefill
row counts, and each captured in a real CUDA graph (no host synchronisation allowed while
capturing) whose replay on new inputs equals the eager call. ``bench/quant_gpu_check.sh``
runs this file on the H200."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()
pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")

from headrace import kernels  # noqa: E402
from headrace.dataplane.quantization import layers  # noqa: E402
from headrace.kernels import quant_libs, reference_quant as ref  # noqa: E402

N, K, GROUP = 1536, 2048, 128
ROWS = (1, 3, 16, 64, 200)


def _fp8_layer(backend: str) -> layers.Fp8Linear:
    g = torch.Generator().manual_seed(0)
    wq, ws = ref.quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.05)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    return layers.Fp8Linear(wq.cuda(), ws.cuda(), None, bias.cuda(), backend)


def _int_layer(backend: str, bits: int) -> layers.WNA16Linear:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32).to(torch.uint8)
    groups = K // GROUP
    scales = torch.rand(groups, N, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=g, dtype=torch.int32)
    g_idx = (torch.arange(K) // GROUP).to(torch.int32)
    return layers.WNA16Linear(ref.pack_along_k(q, bits).cuda(), scales.cuda(),
                              zeros.to(torch.uint8).cuda(), g_idx.cuda(), None, bits, GROUP, None,
                              backend)


def _served_by(monkeypatch, kernel: str, scheme: str, make_layer):
    """A layer (``auto``) whose table ranks ``kernel`` first at every row count, warmed up: its
    plan holds that kernel alone."""
    from headrace.kernels import quant_dispatch
    ranked = {"1": [kernel], "256": [kernel]}
    monkeypatch.setattr(quant_dispatch, "table", lambda: {scheme: {f"{N}x{K}": ranked}})
    layer = make_layer()
    layers.warm_up(layer, 128, torch.bfloat16)
    assert layer.plan.kernels == {kernel}
    return layer


def _replays_like_eager(layer, m: int, replays: int = 1) -> None:
    """The layer on m rows captured in a CUDA graph with host syncs forbidden (after an eager
    call: planned, compiled, its layouts made) replays its eager output on new inputs."""
    static = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    layer(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")    # a host sync while capturing fails
        try:
            out = layer(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for _ in range(replays):
        static.copy_(torch.randn(m, K, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        eager = layer(static).float()          # split-K sums in another order: not bitwise
        torch.testing.assert_close(out.float(), eager, rtol=0,
                                   atol=1e-2 * eager.abs().max().item())


def _expect(layer, x):
    if isinstance(layer, layers.Fp8Linear):
        w8a16 = ref.fp8_weight_linear(x, layer.weight, layer.weight_scale, layer.bias)
        return w8a16, ref.fp8_linear(x, layer.weight, layer.weight_scale, None, layer.bias)
    y = ref.wna16_linear(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, None,
                         layer.bits, layer.group_size)
    return y, y


def _layers():
    made = []
    for backend in ("triton", "torch", "gemlite", "fbgemm"):
        if backend != "triton" and quant_libs.why_not(backend) is not None:
            continue
        made += [(backend, "fp8", lambda b=backend: _fp8_layer(b)),
                 (backend, "w4a16", lambda b=backend: _int_layer(b, 4)),
                 (backend, "w8a16", lambda b=backend: _int_layer(b, 8))]
    return made


@pytest.mark.parametrize("backend,scheme,make", _layers(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_kernel_matches_the_reference_and_replays_in_a_graph(backend, scheme, make):
    layer = make()
    layers.warm_up(layer, 128, torch.bfloat16)
    for m in ROWS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        got = layer(x).float()
        w8a16, w8a8 = (e.float() for e in _expect(layer, x))
        scale = w8a16.abs().max().item()
        err = min((got - w8a16).abs().max().item(), (got - w8a8).abs().max().item())
        assert err <= 2e-2 * scale, (layer.plan.kernel(m), m, err, scale)
    for m in (1, 4, 16):
        _replays_like_eager(layer, m, replays=2)


@pytest.mark.parametrize("backend", [b for b in ("triton", "fbgemm")
                                     if b == "triton" or quant_libs.why_not(b) is None])
def test_fp8_layers_take_quantised_rows_where_their_kernel_quantises(backend):
    """Where an FP8 layer's kernel quantises its rows per token itself (scaled_mm; FBGEMM's
    row-wise GEMM at every row count), rows quantised before it give the layer's own output."""
    layer = _fp8_layer(backend)
    layers.warm_up(layer, 128, torch.bfloat16)
    for m in ROWS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        if not layer.wants_fp8_rows(x):
            assert backend == "triton" and layer.kernel(x) != "scaled_mm"
            continue
        rows = kernels.Fp8Rows(*ref.per_token_fp8(x), torch.bfloat16)
        got, own = layer(rows).float(), layer(x).float()
        torch.testing.assert_close(got, own, rtol=0, atol=2e-2 * own.abs().max().item())


def test_the_w8a8_skinny_kernel_serves_a_layer_in_a_graph_and_on_quantised_rows(monkeypatch):
    """An FP8 layer the table sends to fp8_w8a8 at every row count (``auto``): the W8A8
    reference at decode and prefill rows, a CUDA-graph capture with host syncs forbidden, and
    rows quantised before it (as the norm and SiLU kernels hand them) give the layer's own
    output."""
    layer = _served_by(monkeypatch, "fp8_w8a8", "fp8", lambda: _fp8_layer("auto"))
    for m in ROWS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        want = ref.fp8_linear(x, layer.weight, layer.weight_scale, None, layer.bias).float()
        got = layer(x).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
        assert layer.wants_fp8_rows(x)
        rows = kernels.Fp8Rows(*ref.per_token_fp8(x), torch.bfloat16)
        torch.testing.assert_close(layer(rows).float(), got, rtol=0,
                                   atol=2e-2 * got.abs().max().item())
    _replays_like_eager(layer, 16)


def test_the_inline_w8a8_kernel_serves_a_layer_in_a_graph_on_float_rows(monkeypatch):
    """An FP8 layer the table sends to fp8_w8a8_inline at every row count: the per-128-column
    W8A8 reference at decode and prefill rows; it does not ask for quantised rows (it quantises
    its own), and a CUDA-graph capture with host syncs forbidden replays its eager output."""
    layer = _served_by(monkeypatch, "fp8_w8a8_inline", "fp8", lambda: _fp8_layer("auto"))
    for m in ROWS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        want = ref.fp8_group_linear(x, layer.weight, layer.weight_scale, layer.bias).float()
        torch.testing.assert_close(layer(x).float(), want, rtol=0,
                                   atol=2e-2 * want.abs().max().item())
        assert not layer.wants_fp8_rows(x)
    _replays_like_eager(layer, 16)


def test_the_tiled_int4_kernel_serves_a_layer_in_a_graph(monkeypatch):
    """An INT4 layer the table sends to triton_tiled at every row count: its tiled copy is made
    at the plan (eagerly), the W4A16 reference holds at decode and prefill rows, and a CUDA-graph
    capture with host syncs forbidden replays its eager output."""
    layer = _served_by(monkeypatch, "triton_tiled", "w4a16", lambda: _int_layer("auto", 4))
    assert set(layer.prepared) == {"triton_tiled"}
    for m in ROWS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        want = _expect(layer, x)[0].float()
        torch.testing.assert_close(layer(x).float(), want, rtol=0,
                                   atol=2e-2 * want.abs().max().item())
    _replays_like_eager(layer, 16)
