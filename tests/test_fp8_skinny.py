"""The FP8-weight skinny GEMM (``headrace.kernels.triton_fp8_linear``, W8A16) against its
plain-torch reference (``headrace.kernels.reference_quant.fp8_weight_linear``), and how
``fp8_linear`` picks it.

Under Triton's CPU interpreter here (TRITON_INTERPRET=1, switched on before triton is imported);
with HEADRACE_TEST_DEVICE=cuda (or any CUDA machine) compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.kernels import reference_quant as ref  # noqa: E402
from headrace.kernels import skinny_gemm, triton_fp8_linear, triton_quant  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _case(m, n, k, dtype, per_tensor, bias, seed):
    """Fresh random inputs for one case: an e4m3 weight quantised per row (or with one scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    if per_tensor:
        scale = (w.abs().amax() / ref.FP8_MAX).reshape(1)
        wq = ref.to_fp8(w / scale)
    else:
        wq, scale = ref.quantize_fp8_weight(w)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    b = (torch.randn(n, generator=g)).to(dtype) if bias else None
    return x, wq, scale, b


def _tol(expect, dtype):
    """bfloat16 / float16: a couple of ulps of the output's scale (the interpreter truncates
    float32 -> bfloat16 casts, the GPU and torch round to nearest); float32: accumulation order."""
    scale = expect.float().abs().max().item()
    if dtype == torch.float32:
        return dict(atol=1e-5 * scale, rtol=1e-4)
    return dict(atol=1e-2 * scale, rtol=1e-2)


# every program shape a bucket may run: FMA rows 1 / 2 / 4 (plain and pipelined), swapped tl.dot, K split 2..4 with a
# ragged last slice (the self-cleaning workspace), several row and column tiles; each with rows
# that fill it (ragged where it has more than one row)
TILES = ((1, Tile(1, 32, 64, dot=False)), (2, Tile(2, 16, 128, split=3, dot=False)),
         (3, Tile(4, 16, 32, split=2, dot=False)), (17, Tile(16, 32, 32, split=3)),
         (9, Tile(16, 16, 64)), (40, Tile(32, 64, 32, split=4)),
         # pipelined FMA (a program a row): one row, and two with a ragged K split (the next
         # tile masked at the slice's end, not only at K's)
         (1, Tile(1, 16, 64, stages=1, dot=False, pipe=True)),
         (2, Tile(1, 16, 32, stages=1, split=3, dot=False, pipe=True)))
# (m, n, k, per-tensor scale, bias, dtype): every scale / bias pairing, each dtype, rows of the
# FMA and tl.dot buckets, even and ragged N and K; the fixed tile of each row bucket. Kept to a
# few cases: on the GPU each (tile, dtype, bias, scale kind) is a compile of its own.
CASES = [(1, 64, 128, False, False, torch.bfloat16), (1, 96, 160, True, True, torch.float16),
         (3, 64, 128, True, False, torch.float32), (3, 96, 160, False, True, torch.bfloat16),
         (17, 96, 160, True, False, torch.bfloat16), (17, 64, 128, False, True, torch.float32),
         (40, 96, 160, True, True, torch.float16)]


def _check(dev, expect, dtype, tile=None):
    actual = triton_fp8_linear.fp8_weight_linear(*dev, tile=tile)
    assert actual.dtype == dtype and actual.shape == expect.shape and not actual.isnan().any()
    torch.testing.assert_close(actual.cpu(), expect, **_tol(expect, dtype))
    ws, counters = skinny_gemm.WORKSPACE.buffers[actual.device]
    assert not ws.any() and not counters.any()     # the split-K workspace cleaned itself


@pytest.mark.parametrize("m,n,k,per_tensor,bias,dtype", CASES)
def test_fp8_skinny_matches_reference(poisoned, m, n, k, per_tensor, bias, dtype):
    x, wq, scale, b = _case(m, n, k, dtype, per_tensor, bias, m * 1000 + n * 10 + k)
    expect = ref.fp8_weight_linear(x, wq, scale, b)
    assert expect.dtype == dtype and expect.shape == (m, n)
    _check([None if t is None else t.to(DEVICE) for t in (x, wq, scale, b)], expect, dtype)


@pytest.mark.parametrize("m,tile", TILES, ids=[str(t[1]) for t in TILES])
def test_fp8_skinny_every_program_shape(poisoned, m, tile):
    x, wq, scale, b = _case(m, 96, 160, torch.bfloat16, False, True, m)
    expect = ref.fp8_weight_linear(x, wq, scale, b)
    _check([t.to(DEVICE) for t in (x, wq, scale, b)], expect, torch.bfloat16, tile)


def test_fp8_skinny_leading_dims_and_strided_input(poisoned):
    """x [B, T, K] and a column slice of a wider tensor (rows not contiguous with each other)."""
    x, wq, scale, b = _case(5, 64, 128, torch.bfloat16, False, True, 11)
    wide = torch.randn(5, 200).to(torch.bfloat16)
    wide[:, 40:168] = x
    view = wide.to(DEVICE)[:, 40:168]
    expect = ref.fp8_weight_linear(x, wq, scale, b)
    dev = [t.to(DEVICE) for t in (wq, scale, b)]
    got = triton_fp8_linear.fp8_weight_linear(view, *dev)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.bfloat16))
    x3 = torch.randn(2, 3, 128).to(torch.bfloat16)
    got3 = triton_fp8_linear.fp8_weight_linear(x3.to(DEVICE), *dev)
    assert got3.shape == (2, 3, 64)
    expect3 = ref.fp8_weight_linear(x3, wq, scale, b)
    torch.testing.assert_close(got3.cpu(), expect3, **_tol(expect3, torch.bfloat16))
    assert triton_fp8_linear.fp8_weight_linear(x3[:0].to(DEVICE), *dev).shape == (0, 3, 64)


# the one-row program reads 4-value words: whole K steps (no masks) with N ragged against the
# tile, K split into more slices than it has steps (empty slices), float16 x, and x's row
# starting 2 values into a wider tensor (not 8-byte aligned: copied first)
ONE_ROW = [(Tile(1, 16, 32, stages=1, dot=False, pipe=True), 100, 128, torch.bfloat16, 0),
           (Tile(1, 16, 32, stages=1, split=8, dot=False, pipe=True), 64, 128, torch.bfloat16, 0),
           (Tile(1, 32, 64, stages=1, split=2, dot=False, pipe=True), 96, 192, torch.float16, 0),
           (Tile(1, 16, 64, stages=1, dot=False, pipe=True), 48, 256, torch.bfloat16, 2)]


@pytest.mark.parametrize("tile,n,k,dtype,offset", ONE_ROW, ids=[str(c) for c in range(4)])
def test_fp8_one_row_program(poisoned, tile, n, k, dtype, offset):
    x, wq, scale, b = _case(1, n, k, dtype, False, False, n + k)
    expect = ref.fp8_weight_linear(x, wq, scale, b)
    wide = torch.zeros(1, k + 8, dtype=dtype)
    wide[:, offset:offset + k] = x
    dev = [wide.to(DEVICE)[:, offset:offset + k], wq.to(DEVICE), scale.to(DEVICE), None]
    _check(dev, expect, dtype, tile)


def test_fp8_one_row_program_takes_words_only():
    """float32 x (or K not a multiple of 4) is not the one-row program's: a forced tile is
    refused with the reason, and the fixed choice falls back to the plain FMA program."""
    pipe = Tile(1, 16, 32, stages=1, dot=False, pipe=True)
    x, wq, scale, _ = _case(1, 32, 128, torch.float32, False, False, 7)
    dev = [t.to(DEVICE) for t in (x, wq, scale)]
    with pytest.raises(ValueError, match="16-bit x"):
        triton_fp8_linear.fp8_weight_linear(*dev, tile=pipe)
    expect = ref.fp8_weight_linear(x, wq, scale)
    _check(dev + [None], expect, torch.float32)
    args = {"K": 128, "stride_wn": 128, "X": dev[0], "W": dev[1]}
    assert not triton_fp8_linear._fits(pipe, args)
    assert triton_fp8_linear._fits(pipe, args | {"X": dev[0].to(torch.bfloat16)})
    assert not triton_fp8_linear._fits(pipe, args | {"X": dev[0].half(), "K": 126})
    # a weight starting 2 bytes into its storage (a column view): the plain program runs
    wide = torch.zeros(32, 132, dtype=wq.dtype)
    wide[:, 2:130] = wq
    view = wide.to(DEVICE)[:, 2:130]
    assert not triton_fp8_linear._fits(pipe, args | {"X": dev[0].bfloat16(), "W": view})
    x16 = x.to(torch.bfloat16)
    _check([x16.to(DEVICE), view, dev[2], None], ref.fp8_weight_linear(x16, wq, scale),
           torch.bfloat16)


def test_fp8_weight_reference_is_closer_to_float_than_w8a8():
    """The reference is the dequantised weight's matmul; it only carries the weight's rounding,
    so it is nearer the unquantised linear than W8A8 (which also rounds x to e4m3)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(128, 256, generator=g) * 0.05, torch.randn(8, 256, generator=g)
    wq, ws = ref.quantize_fp8_weight(w)
    w8a16 = ref.fp8_weight_linear(x, wq, ws)
    torch.testing.assert_close(w8a16, x @ (wq.float() * ws[:, None]).t(), atol=1e-5, rtol=1e-5)
    # a per-tensor scale is the same as that scale on every row
    torch.testing.assert_close(ref.fp8_weight_linear(x, wq, ws[:1]),
                               x @ (wq.float() * ws[0]).t(), atol=1e-5, rtol=1e-5)
    dense = x @ w.t()
    err_w8a16 = (w8a16 - dense).abs().mean()
    err_w8a8 = (ref.fp8_linear(x, wq, ws) - dense).abs().mean()
    assert 0 < err_w8a16 < 0.8 * err_w8a8, (err_w8a16, err_w8a8)


def test_fp8_linear_takes_the_skinny_kernel_up_to_the_threshold(monkeypatch):
    """fp8_linear (the GPU op) runs the skinny kernel at decode row counts, _scaled_mm above;
    fp8_kernel names the choice; an explicit kernel overrides it."""
    limit = triton_quant.FP8_SKINNY_MAX_ROWS
    assert triton_quant.fp8_kernel(1) == triton_quant.fp8_kernel(limit) == "fp8_skinny"
    assert triton_quant.fp8_kernel(limit + 1) == "scaled_mm"
    calls = []
    real = triton_fp8_linear.fp8_weight_linear
    monkeypatch.setattr(triton_fp8_linear, "fp8_weight_linear",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(triton_quant, "FP8_SKINNY_MAX_ROWS", 4)
    x, wq, scale, b = _case(4, 64, 128, torch.bfloat16, False, True, 5)
    dev = [t.to(DEVICE) for t in (x, wq, scale, b)]
    got = triton_quant.fp8_linear(dev[0], dev[1], dev[2], None, dev[3])
    assert calls == [(4, 128)]
    expect = ref.fp8_weight_linear(x, wq, scale, b)
    torch.testing.assert_close(got.cpu(), expect, **_tol(expect, torch.bfloat16))
    x5 = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    w8a8 = triton_quant.fp8_linear(x5.to(DEVICE), dev[1], dev[2], None, dev[3])
    assert calls == [(4, 128)]                 # 5 rows: _scaled_mm
    # The GEMM against the rows as the device quantised them: the quantiser (tested in
    # test_quant_kernels) may round a value at an e4m3 boundary to the neighbouring code, which
    # moves an output by a weight times an eighth of that value (seen on the H200: 0.09)
    xq, sx = (t.cpu() for t in triton_quant.per_token_fp8(x5.to(DEVICE)))
    expect5 = (xq.float() * sx) @ ref.dequantize_fp8(wq, scale).t() + b.float()
    torch.testing.assert_close(w8a8.cpu().float(), expect5.to(torch.bfloat16).float(),
                               **_tol(expect5, torch.bfloat16))
    triton_quant.fp8_linear(x5.to(DEVICE), dev[1], dev[2], None, dev[3], kernel="fp8_skinny")
    assert calls == [(4, 128), (5, 128)]
    with pytest.raises(ValueError, match="kernel must be"):
        triton_quant.fp8_linear(x5.to(DEVICE), dev[1], dev[2], kernel="cublas")


def test_fp8_linear_kernel_reports_the_dispatch(monkeypatch):
    """kernels.fp8_linear_kernel: 'reference' wherever the reference runs (no CUDA, or
    HEADRACE_KERNELS=reference), else the GPU op's choice by rows."""
    from headrace import kernels
    if kernels._triton is None:     # this CPU host: the reference runs
        assert kernels.fp8_linear_kernel(1, "cpu") == kernels.fp8_linear_kernel(1) == "reference"
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "auto")
    limit = triton_quant.FP8_SKINNY_MAX_ROWS
    assert kernels.fp8_linear_kernel(8, "cpu") == "reference"
    assert kernels.fp8_linear_kernel(8, "cuda") == "fp8_skinny"
    assert kernels.fp8_linear_kernel(limit + 1, torch.device("cuda", 0)) == "scaled_mm"
    monkeypatch.setattr(kernels, "MODE", "triton")
    assert kernels.fp8_linear_kernel(8, "cpu") == "fp8_skinny"
    monkeypatch.setattr(kernels, "_triton", None)
    assert kernels.fp8_linear_kernel(8, "cuda") == "reference"


def test_fp8_tiles_cover_every_bucket_and_fit_registers():
    """Every row bucket (and the large one) has candidates, a program's tile holds all its rows
    (tl.dot needs 16), and FMA tiles keep at most 64 products a thread in flight."""
    for bucket in skinny_gemm.M_BUCKETS + (skinny_gemm.LARGE,):
        tiles = triton_fp8_linear.TILES[bucket]
        assert tiles, bucket
        for t in tiles:
            if t.dot:
                assert min(t.block_m, t.block_n, t.block_k) >= 16
            else:
                assert t.block_m >= min(bucket, 4)
                assert t.block_m * t.block_n * t.block_k <= 64 * 32 * t.warps, t
