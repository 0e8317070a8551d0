"""The library kernels' side of our weights (``headrace.kernels.quant_libs``): the conversions into
tinygemm's, gemlite's and FBGEMM's layouts against ``headrace.kernels.reference_quant``'s
dequantisation (plain torch, here), tinygemm's through torch's CPU twin of the op, which
layers each kernel takes, and why a library cannot run. The library calls themselves run on
the GPU (tests/test_quant_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from headrace.kernels import quant_libs, reference_quant as ref


def _int_layer(n=64, k=256, bits=4, group=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (k // group, n), generator=g, dtype=torch.int32)
    g_idx = (torch.arange(k) // group).to(torch.int32)
    return q, ref.pack_along_k(q, bits), scales, zeros.to(torch.uint8), g_idx


def test_float_zero_form_is_the_same_weight():
    q, qweight, scales, zeros, g_idx = _int_layer()
    s, z = quant_libs.float_zero_form(scales, zeros, 4)
    g = g_idx.long()
    signed = (q.float() - 8) * s[g].t() + z[g].t()
    torch.testing.assert_close(signed, ref.dequantize_wna16(qweight, scales, zeros, g_idx, 4,
                                                            torch.float32), atol=1e-6, rtol=1e-6)


def test_fbgemm_reads_the_recentred_value_from_each_nibble():
    """FBGEMM's int4 weights are signed (q - 8): a packed byte's low nibble, read as a signed
    4-bit integer, times the scale plus float_zero_form's zero is the reference weight."""
    q = torch.arange(16, dtype=torch.uint8).repeat(3, 2)                  # [3, 32], every value
    packed = quant_libs.pack_nibbles(quant_libs.signed_nibbles(q), high_first=False)
    low, high = packed & 0xF, packed >> 4
    as_signed = lambda v: v.to(torch.int16) - 16 * (v >= 8).to(torch.int16)
    read = torch.stack([as_signed(low), as_signed(high)], dim=2).reshape(3, 32)
    assert torch.equal(read, q.to(torch.int16) - 8)
    scales, zeros = torch.full((1, 3), 0.5), torch.tensor([[3.0, 8.0, 12.0]])
    s, z = quant_libs.float_zero_form(scales, zeros, 4)
    torch.testing.assert_close(read.float() * s[0][:, None] + z[0][:, None],
                               (q.float() - zeros[0][:, None]) * scales[0][:, None])


@pytest.mark.parametrize("high_first", [True, False])
def test_pack_nibbles(high_first):
    q, *_ = _int_layer(8, 16)
    packed = quant_libs.pack_nibbles(q, high_first)
    assert packed.shape == (8, 8) and packed.dtype == torch.uint8
    hi, lo = (packed >> 4).to(torch.uint8), (packed & 0xF).to(torch.uint8)
    even, odd = (hi, lo) if high_first else (lo, hi)
    assert torch.equal(even, q[:, ::2]) and torch.equal(odd, q[:, 1::2])


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                    reason="this torch has no CPU tinygemm")
def test_tinygemm_scales_and_zeros_through_torchs_cpu_int4_gemm():
    """torch's CPU twin of tinygemm reads the same [G, N, 2] scales and float zeros: its
    product equals the reference up to the bfloat16 rounding of scales and zeros."""
    q, qweight, scales, zeros, g_idx = _int_layer()
    sz = quant_libs.tinygemm_scales_and_zeros(scales, zeros)
    assert sz.shape == (2, 64, 2) and sz.dtype == torch.bfloat16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    x = torch.randn(3, 256).to(torch.bfloat16)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 128, sz).float()
    expect = ref.wna16_linear(x.float(), qweight, scales, zeros, g_idx, None, 4, 128)
    assert (got - expect).abs().max() < 0.02 * expect.abs().max()


def test_gemlite_layout_is_the_same_weight():
    """gemlite multiplies by (W_q - zeros) * scales with [N, G] scales and zeros: our tensors
    transposed (what prepare_wna16 hands it)."""
    q, qweight, scales, zeros, g_idx = _int_layer(bits=8, group=128)
    s, z = scales.t(), zeros.t().float()               # [N, G]
    cols = torch.arange(256) // 128
    w = (q.float() - z[:, cols]) * s[:, cols]
    torch.testing.assert_close(w, ref.dequantize_wna16(qweight, scales, zeros, g_idx, 8,
                                                       torch.float32), atol=1e-6, rtol=1e-6)


def test_which_layers_each_library_kernel_takes():
    bf16, fp16, f32 = torch.bfloat16, torch.float16, torch.float32

    def takes(kernel, **kw):
        args = dict(scheme="wna16", n=4096, k=4096, dtype=bf16, bits=4, group_size=128)
        return quant_libs.takes(kernel, **{**args, **kw}, check_library=False)

    assert takes("tinygemm") and not takes("tinygemm", dtype=fp16)
    assert not takes("tinygemm", bits=8) and not takes("tinygemm", group_size=512)
    assert not takes("tinygemm", group_size=0)          # a per-column group index
    assert takes("gemlite", bits=8, dtype=fp16) and not takes("gemlite", dtype=f32)
    assert takes("gemlite", group_size=4096)             # one group per channel
    assert takes("fbgemm_i4") and not takes("fbgemm_i4", group_size=64)
    assert takes("fbgemm_rowwise", scheme="fp8") and takes("gemlite_fp8", scheme="fp8")
    assert not takes("fbgemm_rowwise", scheme="fp8", dtype=fp16)
    assert not takes("triton_skinny") and not takes("tinygemm", scheme="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")
def test_without_a_gpu_no_library_runs_and_says_why():
    for library in ("torch", "gemlite", "fbgemm"):
        assert "CUDA device" in quant_libs.why_not(library)
    assert not quant_libs.takes("tinygemm", scheme="wna16", n=4096, k=4096, dtype=torch.bfloat16,
                                bits=4, group_size=128)


def test_a_missing_package_names_its_install(monkeypatch):
    monkeypatch.setattr(quant_libs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(quant_libs.PACKAGES, "gemlite", ("no_such_module_xyz", "gemlite",
                                                         "pip install 'headrace[gemlite]'"))
    reason = quant_libs._check("gemlite")
    assert "gemlite package is not installed" in reason and "headrace[gemlite]" in reason


@pytest.mark.parametrize("autotune", [False, True])
def test_gemlite_runs_its_default_config_unless_autotuning_is_asked(monkeypatch, autotune):
    """gemlite autotunes every shape its shipped configs lack at the first call (seconds a
    shape and kernel, at every start): its single default config runs instead, unless
    HEADRACE_QUANT_AUTOTUNE=1; an H200 loads the H100's tuned configs."""
    calls = []
    fake = type("Gemlite", (), {"__file__": "/nowhere/gemlite/__init__.py",
                                "load_config": staticmethod(lambda path: calls.append(path)),
                                "set_autotune": staticmethod(lambda mode: calls.append(mode))})
    monkeypatch.setattr(quant_libs.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(quant_libs.quant_dispatch, "AUTOTUNE", autotune)
    quant_libs._gemlite_configs(fake)
    assert calls == ([] if autotune else ["default"])     # no h100.json under /nowhere
