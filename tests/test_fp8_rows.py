"""Activations handed to an FP8 layer already quantised (``kernels.Fp8Rows``): the fused norm and
SiLU kernels of ``headrace.kernels.triton_ops`` against the unfused pair (the bf16 kernel, then the
per-token quantiser) and the references, ``fp8_linear`` over them, and the model choosing the fused
path exactly where its FP8 layer would run ``torch._scaled_mm`` (W8A8, dynamic scales).

Under Triton's CPU interpreter here; with HEADRACE_TEST_DEVICE=cuda compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported
from headrace import kernels  # noqa: E402
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import triton_ops, triton_quant  # noqa: E402


def _rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """m rows of very different magnitudes (one all zero: the scale's floor)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor([1.0, 0.0, 30.0, 1e-3, 300.0, 0.5, 7.0])[torch.arange(m) % 7]
    return (torch.randn(m, k, generator=g) * mags[:, None]).to(dtype).to(DEVICE)


def _dequant_close(rows: kernels.Fp8Rows, q: torch.Tensor, s: torch.Tensor) -> None:
    """Near the reference's quantised rows: the kernels may differ from torch in a norm's last
    bit, which can move a row's max and so every value by one e4m3 step."""
    a = rows.q.float().cpu() * rows.scale.cpu()
    e = q.float().cpu() * s.cpu()
    torch.testing.assert_close(rows.scale.cpu(), s.cpu(), rtol=2e-2, atol=0)
    assert ((a - e).abs() <= e.abs() / 8 + 2.0 ** -9 * s.cpu() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 200])
def test_fused_add_rms_norm_fp8_gives_the_bits_of_norm_then_quantiser(dtype, n):
    x, residual = _rows(9, n, dtype), _rows(9, n, dtype, seed=1)
    weight = (torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(DEVICE)
    rows, res = triton_ops.fused_add_rms_norm_fp8(x, residual, weight, 1e-5)
    normed, want_res = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    q, s = triton_quant.per_token_fp8(normed)
    assert rows.q.dtype == torch.float8_e4m3fn and rows.q.shape == (9, n)
    assert rows.scale.shape == (9, 1) and rows.dtype == dtype
    assert torch.equal(res, want_res)
    assert torch.equal(rows.scale, s) and torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert rows.scale[1].item() == torch.tensor(ref.FP8_MIN_SCALE).item()   # the zero row
    ref_rows, ref_res = ref.fused_add_rms_norm_fp8(x.cpu(), residual.cpu(), weight.cpu(), 1e-5)
    torch.testing.assert_close(res.cpu(), ref_res)
    _dequant_close(rows, ref_rows.q, ref_rows.scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [96, 1000])
def test_silu_and_mul_fp8_gives_the_bits_of_silu_then_quantiser(dtype, d):
    gate_up = _rows(7, 2 * d, dtype)
    rows = triton_ops.silu_and_mul_fp8(gate_up)
    q, s = triton_quant.per_token_fp8(triton_ops.silu_and_mul(gate_up))
    assert rows.q.shape == (7, d) and rows.dtype == dtype
    assert torch.equal(rows.scale, s) and torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    want = ref.silu_and_mul_fp8(gate_up.cpu())
    _dequant_close(rows, want.q, want.scale)


def test_silu_and_mul_fp8_past_one_programs_row_takes_two_kernels(monkeypatch):
    monkeypatch.setattr(triton_ops, "SILU_FP8_MAX_COLS", 64)
    gate_up = _rows(3, 2 * 100, torch.bfloat16)
    rows = triton_ops.silu_and_mul_fp8(gate_up)
    q, s = triton_quant.per_token_fp8(triton_ops.silu_and_mul(gate_up))
    assert torch.equal(rows.scale, s) and torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))


def test_fp8_linear_over_fp8_rows_equals_it_over_the_rows():
    torch.manual_seed(0)
    wq, ws = ref.quantize_fp8_weight(torch.randn(48, 64) * 0.1)
    x = torch.randn(12, 64).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (x, wq, ws, b)]
    rows = kernels.Fp8Rows(*triton_quant.per_token_fp8(dev[0]), torch.bfloat16)
    got = triton_quant.fp8_linear(rows, *dev[1:3], None, dev[3], kernel="scaled_mm")
    want = triton_quant.fp8_linear(*dev[:3], None, dev[3], kernel="scaled_mm")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    ref_rows = kernels.Fp8Rows(*ref.per_token_fp8(x), torch.bfloat16)
    torch.testing.assert_close(ref.fp8_rows_linear(ref_rows, wq, ws, b), ref.fp8_linear(x, wq, ws, None, b))


def _fp8_model(tmp_path, dtype: torch.dtype, backend: str = "auto"):
    """A tiny random Llama quantised to FP8 on load (on the CPU, in ``dtype``)."""
    import dataclasses

    from headrace.dataplane.config import load_model_config
    from headrace.dataplane.loader import load_model
    from headrace.dataplane.quantization import resolve
    from tests import quant_checkpoints as qc

    path = qc.float_model(tmp_path)[0]
    quant = dataclasses.replace(resolve(path, "fp8"), backend=backend)
    return load_model(path, load_model_config(path), torch.device("cpu"), dtype, 512, None, quant)


def _forward(model, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The logits of one prefill of ``tokens`` fixed random tokens."""
    from headrace.dataplane import kv_cache
    from headrace.dataplane.model import AttentionMetadata

    blocks = -(-tokens // 16)
    caches = kv_cache.allocate(model.cfg, blocks, 16, dtype, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32), max_query_len=tokens,
        decode_only=tokens == 1)
    ids = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(tokens), caches, meta))


@pytest.mark.skipif(DEVICE != "cpu", reason="the quantized layers' Triton path set up by hand")
def test_the_model_hands_fp8_layers_quantised_rows_where_they_run_scaled_mm(tmp_path, monkeypatch):
    from headrace.dataplane.quantization import layers
    from headrace.kernels import skinny_gemm

    model = _fp8_model(tmp_path, torch.float32)
    # the quantized layers on the Triton path, the rest reference. The per-token quantiser and
    # the fused kernels run as their references (the tests above hold the kernels to their
    # bits): interpreted, 144 rows through them took ~20 s of this test
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setattr(triton_quant, "per_token_fp8", ref.per_token_fp8)
    fused = []
    for name in ("fused_add_rms_norm_fp8", "silu_and_mul_fp8"):
        real = getattr(ref, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name:
                            fused.append((_name, a[0].shape[0])) or _real(*a))
    layer_count = model.cfg.num_layers

    def forward(tokens: int) -> torch.Tensor:
        return _forward(model, tokens, torch.float32)

    rows = skinny_gemm.MAX_ROWS + 16    # past the skinny kernels' rows: W8A8 through _scaled_mm
    assert kernels.fp8_linear_kernel(rows) == "scaled_mm"
    fused_logits = forward(rows)
    # three of a layer's four inputs arrive quantised (o_proj's comes from attention); the
    # first layer's input norm has no residual to add
    assert fused.count(("fused_add_rms_norm_fp8", rows)) == 2 * layer_count - 1
    assert fused.count(("silu_and_mul_fp8", rows)) == layer_count
    monkeypatch.setattr(layers.Fp8Linear, "wants_fp8_rows", lambda self, x: False)
    plain_logits = forward(rows)
    torch.testing.assert_close(fused_logits, plain_logits, atol=2e-3, rtol=2e-3)
    monkeypatch.undo()
    # a skinny row count (W8A16: the activations are not quantised) keeps the bf16 kernels
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setattr(triton_quant, "per_token_fp8", ref.per_token_fp8)
    fused.clear()
    monkeypatch.setattr(kernels, "fused_add_rms_norm_fp8", lambda *a: fused.append(a) or None)
    forward(8)
    assert fused == []


@pytest.fixture
def fbgemm_twins(monkeypatch):
    """FBGEMM's row-wise FP8 ops as plain-torch twins on the CPU (the library runs on CUDA
    only): its quantiser is ours, its GEMM the reference's (q * scale) @ (w * w_scale)^T.
    Counts the GEMM's calls by whether its rows were quantised by the op's quantiser."""
    if hasattr(torch.ops, "fbgemm") and hasattr(torch.ops.fbgemm, "f8f8bf16_rowwise"):
        pytest.skip("FBGEMM GenAI is installed: its own ops are registered")
    from headrace.kernels import quant_libs

    calls = {"quantiser": 0, "gemm": 0}
    lib = torch.library.Library("fbgemm", "DEF")
    lib.define("quantize_fp8_per_row(Tensor x) -> (Tensor, Tensor)")
    lib.define("f8f8bf16_rowwise(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, "
               "bool use_fast_accum=True) -> Tensor")

    def quantize(x):
        calls["quantiser"] += 1
        q, s = ref.per_token_fp8(x)
        return q, s.reshape(-1)

    def gemm(xq, wq, x_scale, w_scale, use_fast_accum=True):
        calls["gemm"] += 1
        assert xq.dtype == wq.dtype == torch.float8_e4m3fn and x_scale.shape == (xq.shape[0],)
        return ((xq.float() * x_scale[:, None]) @ (wq.float() * w_scale[:, None]).t()).to(torch.bfloat16)

    lib.impl("quantize_fp8_per_row", quantize, "CPU")
    lib.impl("f8f8bf16_rowwise", gemm, "CPU")
    monkeypatch.setattr(quant_libs, "why_not", lambda library: None)
    yield calls
    lib._destroy()


@pytest.mark.skipif(DEVICE != "cpu", reason="FBGEMM's ops as CPU twins")
def test_fbgemm_rowwise_layers_take_the_quantised_rows_too(tmp_path, monkeypatch, fbgemm_twins):
    """With --quant-backend fbgemm every FP8 layer runs FBGEMM's row-wise W8A8 GEMM at any row
    count: the norm and SiLU kernels hand three of a layer's four inputs over quantised, and
    only o_proj's input (and the first layer's qkv's) goes through FBGEMM's quantiser; the
    logits are the unfused path's."""
    from headrace.dataplane.quantization import layers

    model = _fp8_model(tmp_path, torch.bfloat16, backend="fbgemm")
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "triton")
    layer_count = model.cfg.num_layers

    def forward(tokens: int) -> torch.Tensor:
        return _forward(model, tokens, torch.bfloat16)

    for tokens in (8, 40):   # a decode-sized and a larger row count: FBGEMM at both
        fbgemm_twins.update(quantiser=0, gemm=0)
        fused = forward(tokens)
        # o_proj's input comes from attention, the first layer's input norm adds no residual
        assert fbgemm_twins == {"quantiser": layer_count + 1, "gemm": 4 * layer_count}
        with monkeypatch.context() as m:
            m.setattr(layers.Fp8Linear, "wants_fp8_rows", lambda self, x: False)
            fbgemm_twins.update(quantiser=0, gemm=0)
            plain = forward(tokens)
            assert fbgemm_twins == {"quantiser": 4 * layer_count, "gemm": 4 * layer_count}
        torch.testing.assert_close(fused, plain, atol=0, rtol=0)
