"""``--attention-backend``: flag parsing, the clear errors, ``auto``'s fallback and per-phase
table, and the flash-attn-4 path's input preparation, checked on CPU against the reference
through a plain-torch emulation of ``flash_attn_varlen_func``'s paged semantics (with the
argument checks its interface makes). The kernel itself: tests/test_flash_attn_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kernels
from cli.main import build_parser
from common.worker_options import WorkerOptions
from kernels import attention_policy as ap, flash_attn4, reference
from tests.checkpoints import make_checkpoint


def emulate_varlen(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, softmax_scale,
                   causal):
    """flash_attn_varlen_func(q, k, v, cu_seqlens_q=, seqused_k=, page_table=, ...) in plain
    torch: sequence b's queries are q[cu[b]:cu[b+1]], its keys the first seqused_k[b] rows of
    its pages in page_table order, causal aligned bottom-right. Asserts what the real interface
    asserts (or silently relies on) about its arguments."""
    num_pages, page_size, kv_heads, head_dim = k.shape
    batch = cu_seqlens_q.shape[0] - 1
    assert v.shape == k.shape and causal
    for t in (cu_seqlens_q, seqused_k, page_table):
        assert t.dtype == torch.int32 and t.stride(-1) == 1
    assert seqused_k.shape == (batch,) and page_table.shape == (batch, page_table.shape[1])
    cu = cu_seqlens_q.tolist()
    assert cu[0] == 0 and cu[-1] == q.shape[0] and all(a <= b for a, b in zip(cu, cu[1:]))
    used = seqused_k.tolist()
    assert max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q
    assert all(u <= page_table.shape[1] * page_size for u in used)
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        n, ctx = cu[b + 1] - cu[b], used[b]
        if n == 0:
            continue
        assert n <= ctx, "more queries than keys: the bottom-right causal mask would drop rows"
        pages = page_table[b, :-(-ctx // page_size)].long()
        kk = k[pages].flatten(0, 1)[:ctx].float().repeat_interleave(group, 1)
        vv = v[pages].flatten(0, 1)[:ctx].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].float(), kk) * softmax_scale
        row = torch.arange(n)[:, None] + ctx - n
        s.masked_fill_(torch.arange(ctx)[None, :] > row, float("-inf"))
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(q.dtype)
    return out, None


def _batch(rng: random.Random, heads: int, kv_heads: int, head_dim: int, num_decodes: int,
           prefills: int, block_size: int = 16):
    """A step: num_decodes one-token sequences first, then prefill chunks over cached prefixes
    (0 = a fresh prompt), blocks scattered over the pool, unused slots NaN."""
    q_lens = [1] * num_decodes + [rng.randint(1, 40) for _ in range(prefills)]
    ctx = [q + rng.choice([0, 0, rng.randint(1, 70)]) for q in q_lens]
    widths = [-(-c // block_size) for c in ctx]
    pool = list(range(sum(widths) + 3))
    rng.shuffle(pool)
    tables = torch.zeros((len(ctx), max(widths)), dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor([pool.pop() for _ in range(w)], dtype=torch.int32)
    cache = torch.full((2, sum(widths) + 3, block_size, kv_heads, head_dim), float("nan"))
    for i, c in enumerate(ctx):
        for pos in range(c):
            cache[:, tables[i, pos // block_size], pos % block_size] = torch.randn(2, kv_heads, head_dim)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), heads, head_dim)
    return query, cache, qsl, torch.tensor(ctx, dtype=torch.int32), tables, max(q_lens)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_decodes", [0, 3])
def test_flash_attn_preparation_matches_the_reference(group, head_dim, num_decodes):
    """The plan (cu_seqlens from 0 for the prefill part, seqused_k, page_table rows) fed to an
    emulation of flash-attn-4, and the decodes to the reference, give the reference's output."""
    rng = random.Random(group * 1000 + head_dim + num_decodes)
    kv_heads = 2
    query, cache, qsl, lens, tables, longest = _batch(rng, kv_heads * group, kv_heads, head_dim,
                                                      num_decodes, prefills=4)
    scale = head_dim ** -0.5
    plan = flash_attn4.plan(qsl, lens, tables, num_decodes, longest)
    got = flash_attn4.paged_attention(query, cache, plan, scale, kernels._paged_attention,
                                      varlen=emulate_varlen)
    want = reference.paged_attention(query, cache, qsl, lens, tables, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_tensors_ignore_a_flash_plan():
    rng = random.Random(3)
    query, cache, qsl, lens, tables, longest = _batch(rng, 4, 2, 64, 2, 2)
    plan = flash_attn4.plan(qsl, lens, tables, 2, longest)
    torch.testing.assert_close(kernels.paged_attention(query, cache, qsl, lens, tables, 0.125, flash=plan),
                               reference.paged_attention(query, cache, qsl, lens, tables, 0.125))


def test_the_flag_parses_and_rejects_unknown_backends(capsys):
    parser = build_parser()
    assert parser.parse_args(["dataplane"]).attention_backend == "auto"
    for name in ap.BACKENDS:
        assert parser.parse_args(["dataplane", "--attention-backend", name]).attention_backend == name
        assert parser.parse_args(["serve", "--attention-backend", name]).attention_backend == name
    with pytest.raises(SystemExit):
        parser.parse_args(["dataplane", "--attention-backend", "flashinfer"])
    assert "invalid choice" in capsys.readouterr().err
    assert WorkerOptions(model="m").attention_backend == "auto"


def test_explicit_flash_attn_fails_clearly_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"^--attention-backend flash-attn: flash-attn-4 needs a "
                                         r"CUDA device \(--device cpu\)"):
        ap.resolve("flash-attn", "cpu", None)
    why = "the flash-attn-4 package is not installed"
    with pytest.raises(ValueError, match=f"^--attention-backend flash-attn: {why}"):
        ap.resolve("flash-attn", "cuda", why)
    with pytest.raises(ValueError, match="choose from auto, triton, flash-attn"):
        ap.resolve("flashinfer", "cuda", None)


def test_unusable_names_the_missing_package_or_device():
    assert "needs a CUDA device" in flash_attn4.unusable(torch.device("cpu"), torch.bfloat16,
                                                         torch.bfloat16, 128)
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        why = flash_attn4.unusable(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)
        assert why.startswith("the flash-attn-4 package is not installed")
        assert "pip install 'headrace[flash-attn]'" in why


def test_auto_falls_back_to_triton_and_says_why():
    policy = ap.resolve("auto", "cuda", "the flash-attn-4 package is not installed")
    assert policy.backend == "triton" and not policy.uses_flash
    assert "flash-attn not used: the flash-attn-4 package is not installed" in policy.describe()
    assert policy.choose(False, 0, 30000, 30000) == "triton"
    assert ap.resolve("auto", "cpu", None).backend == "triton"
    assert ap.resolve("triton", "cuda", None).table() == dict.fromkeys(ap.PHASES, "triton")


def test_the_selection_table():
    auto, flash = ap.resolve("auto", "cuda", None), ap.resolve("flash-attn", "cuda", None)
    x = ap.FLASH_ATTN_CROSSOVER_TOKENS
    assert auto.backend == "auto" and flash.backend == "flash-attn"
    for policy in (auto, flash):   # decodes stay on Triton (CUDA graphs, split-KV)
        assert policy.choose(True, 64, 64, 32768) == "triton"
        assert policy.choose(False, 5, 5, 4096) == "triton"   # no prefill part
    # prefill: a dense prompt at the crossover and just below
    assert auto.choose(False, 0, x, x) == "flash-attn"
    assert auto.choose(False, 0, x - 64, x - 64) == "triton"
    assert auto.choose(False, 0, 16, 32) == "triton"
    # a short chunk over a long cached prefix counts its pairs: 2048 x 28k is long
    assert auto.choose(False, 0, 2048, 28672) == "flash-attn"
    assert auto.choose(False, 0, 2048, 2048) == ("flash-attn" if x <= 2048 else "triton")
    # mixed: the decodes' tokens do not count
    assert auto.choose(False, 40, 40 + x, x) == "flash-attn"
    assert auto.choose(False, 40, 41, x) == "triton"
    assert flash.choose(False, 0, 1, 16) == flash.choose(False, 3, 4, 16) == "flash-attn"
    table = auto.table()
    assert table["decode"] == "triton" and f"from {x} equivalent tokens" in table["prefill"]
    assert "decodes: triton" in table["mixed"]


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 70000), ctx=st.integers(1, 70000), more=st.integers(0, 5000),
       decodes=st.integers(0, 200))
def test_auto_is_monotone_in_the_work(tokens, ctx, more, decodes):
    """Once a step goes to flash-attn, a bigger one (more tokens or context) does too."""
    auto = ap.resolve("auto", "cuda", None)
    if auto.choose(False, decodes, decodes + tokens, ctx) == "flash-attn":
        assert auto.choose(False, decodes, decodes + tokens + more, ctx) == "flash-attn"
        assert auto.choose(False, decodes, decodes + tokens, ctx + more) == "flash-attn"


def test_step_plan_only_for_flash_steps():
    qsl = torch.tensor([0, 1, 2, 5000], dtype=torch.int32)
    lens = torch.tensor([10, 20, 5000], dtype=torch.int32)
    tables = torch.zeros((3, 313), dtype=torch.int32)
    auto, triton = ap.resolve("auto", "cuda", None), ap.resolve("triton", "cuda", None)
    assert flash_attn4.step_plan(None, qsl, lens, tables, 16, 5000, 4998, False, 2) is None
    assert flash_attn4.step_plan(triton, qsl, lens, tables, 16, 5000, 4998, False, 2) is None
    assert flash_attn4.step_plan(auto, qsl[:3], lens[:2], tables[:2], 16, 2, 1, True, 2) is None
    plan = flash_attn4.step_plan(auto, qsl, lens, tables, 16, 5000, 4998, False, 2)
    assert plan.num_decodes == 2 and plan.max_seqlen_q == 4998
    assert plan.cu_seqlens_q.tolist() == [0, 4998] and plan.cu_seqlens_q.dtype == torch.int32
    assert plan.seqused_k.tolist() == [5000] and plan.page_table.shape == (1, 313)
    assert [t.shape[0] for t in plan.decode_meta] == [3, 2, 2]


def test_a_worker_on_cpu_refuses_an_explicit_flash_attn(tmp_path):
    from dataplane.worker import Worker, load_failure

    model = make_checkpoint(tmp_path / "m", "llama", heads=4, kv_heads=2, head_dim=32)
    opts = WorkerOptions(model=str(model), num_kv_blocks=8, attention_backend="flash-attn")
    with pytest.raises(ValueError) as info:
        Worker(opts)
    assert load_failure(info.value, opts).startswith("--attention-backend flash-attn: flash-attn-4 "
                                                     "needs a CUDA device")
    worker = Worker(WorkerOptions(model=str(model), num_kv_blocks=8))   # auto: the reference
    assert worker.attention.backend == "triton" and worker.runner.attention is worker.attention


@pytest.mark.parametrize("max_seqs, batches", [(256, [1]), (300, [1, 257])])
def test_warm_up_compiles_every_variant_a_step_can_pick(max_seqs, batches, monkeypatch):
    """flash-attn-4 compiles another kernel for batches past LOOKUP_BATCH sequences: the
    warm-up runs one when the worker can hold that many (here through the emulation)."""
    seen = []

    def varlen(**kw):
        seen.append(kw["cu_seqlens_q"].shape[0] - 1)
        return emulate_varlen(**kw)

    monkeypatch.setattr(flash_attn4, "_varlen", varlen)
    cache = torch.zeros(2, 4, 16, 2, 64)
    flash_attn4.warm_up(cache, 4, torch.float32, max_seqs)
    assert seen == batches and flash_attn4.LOOKUP_BATCH == 256


def test_unusable_says_what_the_device_or_model_lacks(monkeypatch):
    """With the package importable: the GPU generation, the dtype, an FP8 cache, head_dim."""
    monkeypatch.setattr(flash_attn4, "load", lambda: None)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert flash_attn4.unusable(cuda, bf16, bf16, 128) is None
    assert flash_attn4.unusable(cuda, torch.float16, torch.float16, 64) is None
    assert "bfloat16 or float16" in flash_attn4.unusable(cuda, torch.float32, torch.float32, 128)
    assert "--kv-cache-dtype auto" in flash_attn4.unusable(cuda, bf16, torch.float8_e4m3fn, 128)
    assert "head_dim 8..256" in flash_attn4.unusable(cuda, bf16, bf16, 100)
    assert flash_attn4.unusable(cuda, bf16, bf16, 256) is None
    cap["value"] = (10, 0)
    assert "head_dim 8..128" in flash_attn4.unusable(cuda, bf16, bf16, 256)
    for old in ((8, 0), (12, 0)):
        cap["value"] = old
        assert "SM90/SM100" in flash_attn4.unusable(cuda, bf16, bf16, 128)
