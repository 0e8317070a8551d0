"""A decode's projection with its LoRA update in one launch (``headrace.kernels.triton_lora_linear``)
against the projection followed by the separate update (``triton_linear.linear`` then
``triton_lora.lora_add``: the same bits) and against the plain-torch reference; its counters
left at zero; the fallbacks where the one launch does not apply. Compiled on a GPU, else under
Triton's CPU interpreter (small shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported
from headrace.kernels import (  # noqa: E402
    reference_lora as ref, triton_linear, triton_lora, triton_lora_linear)


def _case(tokens, k, slices, rank, num_slots, dtype, seed, none_every=3, bias=False):
    g = torch.Generator().manual_seed(seed)
    n, pieces = slices[-1], len(slices) - 1
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    a = (torch.randn(num_slots, pieces * rank, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(num_slots, n, rank, generator=g).to(dtype)
    bias_t = torch.randn(n, generator=g).to(dtype) if bias else None
    slots = torch.randint(0, num_slots, (tokens,), generator=g)
    if none_every:
        slots[::none_every] = -1
    return x, w, bias_t, a, b, slots


def _ulp(dtype):
    return {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


def _dev(meta):
    return ref.LoraMeta(meta.order.to(DEVICE), tuple(b.to(DEVICE) for b in meta.blocks), meta.segments)


def _to(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


CASES = [   # tokens, k, slices, rank, slots, bias
    (1, 256, (0, 64), 16, 4, False),              # a batch-1 decode (W2)
    (5, 320, (0, 32, 48, 64), 8, 3, True),        # q/k/v, rank 8 padded to 16 columns a slice
    (16, 192, (0, 48, 96), 16, 8, False),         # gate/up, 16 tokens over 8 slots
    (9, 128, (0, 32), 32, 2, False),              # rank 32
    (3, 2304, (0, 32), 8, 2, False),              # a long K of a small weight (a down_proj)
]


def _one_launch(dtype, tokens, k, slices, rank, num_slots, bias):
    """(one launch, the projection then lora_add, the projection, the reference, rows of no
    adapter) of a case; the counters checked back at zero."""
    x, w, bias_t, a, b, slots = _case(tokens, k, slices, rank, num_slots, dtype, seed=tokens + k, bias=bias)
    meta_host = ref.meta_of(slots, num_slots)
    expected = ref.lora_linear(x, w, bias_t, a, b, meta_host, slices, scale=0.5)
    x, w, bias_t, a, b = _to(x, w, bias_t, a, b)
    meta = _dev(meta_host)
    assert triton_lora_linear.plan(tokens, w, a, slices) is not None   # (the one launch runs)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = triton_lora_linear.lora_linear(x, w, bias_t, a, b, meta, slices, sync, scale=0.5)
    assert sync.tolist() == [0, 0]   # the counters reset for the next launch
    plain = triton_linear.linear(x, w, bias_t)
    separate = triton_lora.lora_add(plain.clone().contiguous(), x, a, b, meta, slices, scale=0.5)
    return got, separate, plain, expected, (slots < 0).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,slices,rank,num_slots,bias", CASES)
def test_one_launch_matches_the_projection_then_the_update(dtype, tokens, k, slices, rank, num_slots, bias):
    got, separate, plain, expected, base = _one_launch(dtype, tokens, k, slices, rank, num_slots, bias)
    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got.cpu().float(), expected.float(), **tol)
    if triton_linear._tiles(slices[-1], k) is not None:   # (else torch's GEMM: other roundings)
        torch.testing.assert_close(got, separate, **_ulp(dtype))
        torch.testing.assert_close(got[base], plain[base], **_ulp(dtype))


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's matmuls may block their sums by shape")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,slices,rank,num_slots,bias", [c for c in CASES if c[1] <= 2048])
def test_one_launch_has_the_separate_kernels_bits(dtype, tokens, k, slices, rank, num_slots, bias):
    """Compiled: the same K slices and roundings as the skinny GEMM then the split-K update."""
    got, separate, plain, _, base = _one_launch(dtype, tokens, k, slices, rank, num_slots, bias)
    assert torch.equal(got, separate) and torch.equal(got[base], plain[base])


def test_repeated_launches_and_steps_without_adapters():
    """The counters are reused launch after launch (as a CUDA graph replays them); a step whose
    tokens have no adapter gets the projection alone."""
    x, w, _, a, b, slots = _case(6, 256, (0, 64), 16, 2, torch.float32, seed=7, none_every=0)
    x, w, a, b = _to(x, w, a, b)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    meta = _dev(ref.meta_of(slots, 2))
    first = triton_lora_linear.lora_linear(x, w, None, a, b, meta, (0, 64), sync)
    for _ in range(3):
        assert torch.equal(triton_lora_linear.lora_linear(x, w, None, a, b, meta, (0, 64), sync), first)
    nobody = _dev(ref.meta_of(torch.full((6,), -1), 2))
    alone = triton_lora_linear.lora_linear(x, w, None, a, b, nobody, (0, 64), sync)
    torch.testing.assert_close(alone, triton_linear.linear(x, w), atol=1e-5, rtol=1e-5)
    assert sync.tolist() == [0, 0]


@pytest.mark.parametrize("tokens,k,slices", [
    (17, 128, (0, 64)),          # more rows than a decode's block: the separate path
    (3, 128, (0, 40, 64)),       # a slice boundary off the column tile
    (2, 2304, (0, 4096)),        # a long K and a large weight: torch's GEMM for the projection
])
def test_fallbacks_give_the_same_result(tokens, k, slices):
    x, w, _, a, b, slots = _case(tokens, k, slices, 8, 3, torch.float32, seed=11)
    meta_host = ref.meta_of(slots, 3)
    expected = ref.lora_linear(x, w, None, a, b, meta_host, slices)
    x, w, a, b = _to(x, w, a, b)
    assert triton_lora_linear.plan(tokens, w, a, slices) is None
    got = triton_lora_linear.lora_linear(x, w, None, a, b, _dev(meta_host), slices)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,slices,rank,num_slots", [
    (1, 256, (0, 128), 16, 4),               # batch 1
    (12, 320, (0, 64, 128, 192), 8, 3),      # q/k/v over 3 slots
    (16, 2304, (0, 128), 16, 2),             # a long K
])
def test_the_update_alone_in_one_launch(dtype, tokens, k, slices, rank, num_slots):
    """``lora_update`` (after torch's GEMM or a quantized one): the split-K update's output."""
    x, _, _, a, b, slots = _case(tokens, k, slices, rank, num_slots, dtype, seed=tokens)
    y = torch.randn(tokens, slices[-1], generator=torch.Generator().manual_seed(5)).to(dtype)
    meta_host = ref.meta_of(slots, num_slots)
    expected = ref.lora_add(y.clone(), x, a, b, meta_host, slices, scale=0.5)
    x, a, b, y = _to(x, a, b, y)
    meta = _dev(meta_host)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = triton_lora_linear.lora_update(y.clone(), x, a, b, meta, slices, sync, scale=0.5)
    assert sync.tolist() == [0, 0]
    separate = triton_lora.lora_add(y.clone(), x, a, b, meta, slices, scale=0.5)
    torch.testing.assert_close(got, separate, **_ulp(dtype))
    none = (slots < 0).to(DEVICE)
    assert torch.equal(got[none], y[none])   # rows of no adapter: unchanged
    tol = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu().float(), expected.float(), **tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's matmuls may block their sums by shape")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_alone_has_the_separate_kernels_bits(dtype):
    x, _, _, a, b, slots = _case(12, 320, (0, 64, 128, 192), 8, 3, dtype, seed=12)
    y = torch.randn(12, 192, generator=torch.Generator().manual_seed(5)).to(dtype)
    x, a, b, y = _to(x, a, b, y)
    meta = _dev(ref.meta_of(slots, 3))
    got = triton_lora_linear.lora_update(y.clone(), x, a, b, meta, (0, 64, 128, 192), scale=0.5)
    assert torch.equal(got, triton_lora.lora_add(y.clone(), x, a, b, meta, (0, 64, 128, 192), scale=0.5))


def test_reference_is_the_projection_then_lora_add():
    x, w, bias, a, b, slots = _case(4, 32, (0, 16, 24, 32), 4, 2, torch.float32, seed=2, bias=True)
    meta = ref.meta_of(slots, 2)
    y = torch.nn.functional.linear(x, w, bias)
    torch.testing.assert_close(ref.lora_linear(x, w, bias, a, b, meta, (0, 16, 24, 32), scale=2.0),
                               ref.lora_add(y.clone(), x, a, b, meta, (0, 16, 24, 32), scale=2.0))


_COMPILE = """
import json, pathlib, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from headrace.kernels import triton_lora_linear as m

kernel, out = m._lora_linear_kernel, {}
names = kernel.arg_names
consts = {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SHRINK_N": 64,
          "SHRINK_K": m.SHRINK_TILE // 64, "BLOCK_R": 16, "PRECISION": "tf32", "DOT_F32": False,
          "PROJECT": True}
sig = {n: "constexpr" if n in consts else "*bf16" if n in ("X", "W", "BIAS", "OUT", "A", "B")
       else "*fp32" if n == "BUF" else "*i32" if n in ("SYNC", "ORDER", "BLOCKS")
       else "fp32" if n == "scale" else "i32" for n in names}
tools = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"
if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
    print(json.dumps({"skip": f"this Triton has no bundled ptxas / cuobjdump in {tools}"}))
    sys.exit(0)
compiled = triton.compile(ASTSource(fn=kernel, signature=sig,   # (an error here fails the test)
                                    constexprs={(names.index(n),): v for n, v in consts.items()}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 5})
out["ptx"] = compiled.asm["ptx"]
cubin = pathlib.Path(sys.argv[1])
cubin.write_bytes(compiled.asm["cubin"])
out["usage"] = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                              text=True, timeout=60, check=True).stdout
print(json.dumps(out))
"""


def test_compiles_for_hopper_within_its_registers(tmp_path):
    """The kernel compiles for sm_90 (no GPU needed: Triton's bundled ptxas; a process without
    the interpreter), with its count and its wait, and its shrink programs do not set the whole
    launch's registers (a 64 x 128 A step took 247 a thread, the skinny GEMM alone ~95)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / "k.cubin")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"no CUDA toolchain to compile for sm_90: {out['skip']}")
    assert "red.global.gpu.release.add" in out["ptx"] and "ld.global.gpu.acquire" in out["ptx"]
    assert "REG:" in out["usage"], out["usage"]
    regs = int(out["usage"].split("REG:")[1].split()[0])
    assert regs <= 192, out["usage"]
