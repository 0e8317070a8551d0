"""``--attention-backend``: flag parsing, the clear errors, ``auto``'s fallback and per-phase
table, and the flash-attn-4 path's input preparation, checked on CPU against the reference
through a plain-torch emulation of ``flash_attn_varlen_func``'s paged semantics (with the
argument checks its interface makes). The kernel itself: tests/test_flash_attn_gpu.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from headrace import kernels
from headrace.cli.main import build_parser
from headrace.common.worker_options import WorkerOptions
from headrace.kernels import attention_policy as ap, flash_attn4, reference
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
    assert policy.choose(False, 0, 10 ** 9) == "triton"
    assert ap.resolve("auto", "cpu", None).backend == "triton"
    assert ap.resolve("triton", "cuda", None).table() == dict.fromkeys(ap.PHASES, "triton")


def _pairs(q_lens, ctx, decodes=0):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return ap.prefill_pairs(qsl, np.asarray(ctx, dtype=np.int32), decodes)


def test_the_selection_table():
    auto, flash = ap.resolve("auto", "cuda", None), ap.resolve("flash-attn", "cuda", None)
    x = ap.FLASH_ATTN_CROSSOVER_TOKENS
    assert auto.backend == "auto" and flash.backend == "flash-attn"
    for policy in (auto, flash):   # decodes stay on Triton (CUDA graphs, split-KV)
        assert policy.choose(True, 64, 10 ** 9) == "triton"
        assert policy.choose(False, 5, _pairs([1] * 5, [4096] * 5, 5)) == "triton"   # no prefill
    # prefill: a dense prompt at the crossover and just below
    assert auto.choose(False, 0, _pairs([x], [x])) == "flash-attn"
    assert auto.choose(False, 0, _pairs([x - 1], [x - 1])) == "triton"
    # a short chunk over a long cached prefix counts what it attends to
    assert auto.choose(False, 0, _pairs([2048], [28672])) == "flash-attn"
    # W1's first steps: ~29 prompts of ~560 tokens are a ~3k prompt's work, past the crossover
    # (2,048 on the H200); ten such prompts are a ~1.8k prompt's, below it
    assert _pairs([560] * 29, [560] * 29) >= x * (x + 1) // 2 == _pairs([x], [x])
    assert _pairs([560] * 10, [560] * 10) < x * (x + 1) // 2
    # mixed: the decodes' long contexts do not count
    assert auto.choose(False, 40, _pairs([1] * 40 + [16], [30000] * 40 + [16], 40)) == "triton"
    assert auto.choose(False, 40, _pairs([1] * 40 + [x], [30000] * 40 + [x], 40)) == "flash-attn"
    assert flash.choose(False, 3, _pairs([1] * 3 + [2], [9, 9, 9, 2], 3)) == "flash-attn"
    table = auto.table()
    assert table["decode"] == "triton" and f"from {x} equivalent tokens" in table["prefill"]
    assert "decodes: triton" in table["mixed"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 500)), min_size=1, max_size=8),
       st.integers(0, 3))
def test_prefill_pairs_counts_the_visible_keys(seqs, decodes):
    """Against a count of the causal mask itself: query i of a q-token chunk ending a context
    of c sees c - q + i + 1 keys; the first ``decodes`` sequences are left out."""
    q_lens = [1] * decodes + [q for q, _ in seqs]
    ctx = [1 + p for p in range(decodes)] + [q + p for q, p in seqs]
    want = sum(c - q + i + 1 for q, c in zip(q_lens[decodes:], ctx[decodes:]) for i in range(q))
    assert _pairs(q_lens, ctx, decodes) == want


def test_step_plan_only_for_flash_steps():
    import types

    prep = types.SimpleNamespace(query_start_loc=np.array([0, 1, 2, 5000], dtype=np.int32),
                                 seq_lens=np.array([10, 20, 5000], dtype=np.int32),
                                 num_decodes=2, decode_only=False, max_query_len=4998)
    qsl, lens = torch.from_numpy(prep.query_start_loc), torch.from_numpy(prep.seq_lens)
    tables = torch.zeros((3, 313), dtype=torch.int32)
    auto, triton = ap.resolve("auto", "cuda", None), ap.resolve("triton", "cuda", None)
    assert flash_attn4.step_plan(None, prep, qsl, lens, tables) is None
    assert flash_attn4.step_plan(triton, prep, qsl, lens, tables) is None
    plan = flash_attn4.step_plan(auto, prep, qsl, lens, tables)
    assert plan.num_decodes == 2 and plan.max_seqlen_q == 4998
    assert plan.cu_seqlens_q.tolist() == [0, 4998] and plan.cu_seqlens_q.dtype == torch.int32
    assert plan.seqused_k.tolist() == [5000] and plan.page_table.shape == (1, 313)
    assert [t.shape[0] for t in plan.decode_meta] == [3, 2, 2]
    short = types.SimpleNamespace(**{**vars(prep), "query_start_loc": np.array([0, 1, 2, 100], dtype=np.int32),
                                     "seq_lens": np.array([10, 20, 100], dtype=np.int32)})
    assert flash_attn4.step_plan(auto, short, qsl, lens, tables) is None
    assert flash_attn4.step_plan(auto, types.SimpleNamespace(**{**vars(prep), "decode_only": True}),
                                 qsl, lens, tables) is None


def test_a_worker_on_cpu_refuses_an_explicit_flash_attn(tmp_path):
    from headrace.dataplane.worker import Worker, load_failure

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


def test_the_runner_plans_once_per_step_from_its_metadata(tmp_path, monkeypatch):
    """A prefill step, then a mixed one (a decode first): the runner hands the plan of each to
    the model (on CPU the kernels ignore it, so the tokens are the reference's)."""
    from headrace.dataplane.worker import Worker
    from headrace.worker.v1 import worker_pb2 as wpb

    model = make_checkpoint(tmp_path / "m", "qwen3", heads=4, kv_heads=2, head_dim=32)
    worker = Worker(WorkerOptions(model=str(model), num_kv_blocks=16))
    worker.runner.attention = ap.Policy("flash-attn", "flash-attn")
    plans, real = [], flash_attn4.step_plan
    monkeypatch.setattr(flash_attn4, "step_plan", lambda *a: plans.append(real(*a)) or plans[-1])
    sampling = wpb.Sampling(top_p=1, repetition_penalty=1)
    first = wpb.StepRequest(step_id=1)
    first.new_seqs.add(seq_id=1, prompt_token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3,
                       sampling=sampling)
    second = wpb.StepRequest(step_id=2, running_seq_ids=[1], running_num_scheduled=[1],
                             running_new_block_counts=[0])
    second.new_seqs.add(seq_id=2, prompt_token_ids=[9] * 20, block_ids=[1, 2], num_scheduled_tokens=20,
                        sampling=sampling)
    for step in (first, second):
        worker.runner.finish(worker.runner.launch(step))
    assert [p.num_decodes for p in plans] == [0, 1]
    assert plans[0].cu_seqlens_q.tolist() == [0, 3] and plans[0].seqused_k.tolist() == [3]
    assert plans[1].cu_seqlens_q.tolist() == [0, 20] and plans[1].seqused_k.tolist() == [20]
    assert plans[1].page_table.tolist() == [[1, 2]] and plans[1].max_seqlen_q == 20
    assert [t.tolist() for t in plans[1].decode_meta] == [[0, 1], [4], [[0, 0]]]
