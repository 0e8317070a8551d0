"""flash-attn-4 on the GPU (HEADRACE_TEST_DEVICE=cuda with flash-attn-4 importable; skipped
otherwise): its prefill over our paged KV against the plain-torch reference and our Triton
kernels (GQA 1-8, head_dim 64 and 128, fresh prompts, chunks over cached prefixes, mixed steps
with decodes first, 16- and 128-token blocks), and greedy decoding end to end in bfloat16
with ``--attention-backend flash-attn`` and ``triton`` beside transformers."""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import pytest
import torch

from headrace import kernels
from headrace.controlplane.engine.loop import EngineConfig
from headrace.kernels import flash_attn4, reference


def _why_not() -> str | None:
    if not os.environ.get("HEADRACE_TEST_DEVICE", "").startswith("cuda"):
        return "HEADRACE_TEST_DEVICE is not cuda"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return flash_attn4.unusable(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _step(rng: random.Random, heads: int, kv_heads: int, head_dim: int, q_lens: list[int],
          prefixes: list[int], block_size: int = 16, garbage: float = 1e3):
    """Query and a paged cache for sequences computing q_lens[i] tokens after prefixes[i]
    cached ones; blocks scattered over the pool; every slot not written holds ``garbage``."""
    ctx = [q + p for q, p in zip(q_lens, prefixes)]
    widths = [-(-c // block_size) for c in ctx]
    pool = list(range(sum(widths) + 4))
    rng.shuffle(pool)
    tables = torch.zeros((len(ctx), max(widths)), dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor([pool.pop() for _ in range(w)], dtype=torch.int32)
    cache = torch.full((2, len(pool) + sum(widths), block_size, kv_heads, head_dim), garbage,
                       dtype=BF16, device=DEV)
    slots = torch.cat([tables[i, torch.arange(c) // block_size].long() * block_size
                       + torch.arange(c) % block_size for i, c in enumerate(ctx)]).to(DEV)
    kv = torch.randn(2, len(slots), kv_heads, head_dim, device=DEV)
    reference.write_kv(cache, kv[0], kv[1], slots)
    qsl = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), heads, head_dim, device=DEV, dtype=BF16)
    return (query, cache, qsl.to(DEV), torch.tensor(ctx, dtype=torch.int32, device=DEV),
            tables.to(DEV), max(q_lens))


CASES = {   # name: (decodes, [(q_len, cached prefix)], block_size)
    "prompts": (0, [(1, 0), (17, 0), (130, 0), (300, 0), (64, 0)], 16),
    "prefix-hits": (0, [(40, 160), (1, 33), (200, 700), (129, 127)], 16),
    "mixed": (5, [(90, 0), (33, 250), (256, 256)], 16),
    "pages-128": (3, [(300, 0), (70, 400), (129, 1)], 128),
}


# (head_dim, GQA group): each pair is a kernel flash-attn-4 compiles (seconds each)
SHAPES = [(64, 1), (64, 4), (64, 8), (128, 1), (128, 2), (128, 4), (128, 8)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim, group", SHAPES)
def test_flash_attn_matches_reference_and_triton(case, head_dim, group):
    decodes, seqs, block_size = CASES[case]
    if block_size == 128 and (head_dim, group) not in ((64, 4), (128, 4)):
        pytest.skip("128-token pages (the TMA path): two shapes are enough")
    rng = random.Random(hash((case, head_dim, group)) % 10000)
    q_lens = [1] * decodes + [q for q, _ in seqs]
    prefixes = [rng.randint(1, 900) for _ in range(decodes)] + [p for _, p in seqs]
    kv_heads = 2
    query, cache, qsl, lens, tables, longest = _step(rng, kv_heads * group, kv_heads, head_dim,
                                                     q_lens, prefixes, block_size)
    scale = head_dim ** -0.5
    plan = flash_attn4.plan(qsl, lens, tables, decodes, longest)
    hints = dict(max_query_len=longest, num_decodes=decodes,
                 decode_order=torch.arange(decodes, dtype=torch.int32, device=DEV))
    got = kernels.paged_attention(query, cache, qsl, lens, tables, scale, flash=plan, **hints)
    triton = kernels.paged_attention(query, cache, qsl, lens, tables, scale, **hints)
    want = reference.paged_attention(query, cache, qsl, lens, tables, scale)
    assert got.dtype == BF16 and got.shape == query.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), triton.float(), atol=2e-2, rtol=2e-2)


def test_a_long_chunk_over_a_long_prefix():
    """A 2048-token chunk after 6144 cached tokens (Llama-3.1-8B's 32/8 heads)."""
    rng = random.Random(7)
    query, cache, qsl, lens, tables, longest = _step(rng, 32, 8, 128, [2048], [6144])
    plan = flash_attn4.plan(qsl, lens, tables, 0, longest)
    got = kernels.paged_attention(query, cache, qsl, lens, tables, 128 ** -0.5, flash=plan)
    want = reference.paged_attention(query, cache, qsl, lens, tables, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_unwritten_slots_holding_nan_do_not_leak_through_16_token_pages():
    """Our Triton kernels' contract: NaN in slots past a sequence's length never reaches it.
    (flash-attn-4 promises it for pages loaded by cp.async, i.e. any page size but its key tile.)"""
    rng = random.Random(3)
    query, cache, qsl, lens, tables, longest = _step(rng, 8, 2, 128, [37, 5, 100], [0, 60, 3],
                                                     garbage=float("nan"))
    plan = flash_attn4.plan(qsl, lens, tables, 0, longest)
    got = kernels.paged_attention(query, cache, qsl, lens, tables, 128 ** -0.5, flash=plan)
    assert not got.isnan().any()


def _hf_greedy(hf, prompt: list[int], steps: int):
    out = hf.generate(torch.tensor([prompt], device=DEV), max_new_tokens=steps, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 0)[:, 0].float().log_softmax(-1)


def _agree(ids, logprobs, ref_ids, ref_logprobs, tol=0.25):
    """bfloat16 implementations may part at a near-tie: equal ids and logprobs up to the first
    difference, where transformers must rate our token within ``tol`` of its own."""
    for step, (ours, theirs) in enumerate(zip(ids, ref_ids)):
        ref = ref_logprobs[step]
        if ours != theirs:
            assert ref[theirs] - ref[ours] <= tol, f"step {step}: {ours} vs {theirs}, no near-tie"
            return step
        assert logprobs[step] == pytest.approx(ref[ours].item(), abs=tol + 0.02 * abs(ref[ours].item()))
    return len(ids)


@pytest.mark.parametrize("backend", ["flash-attn", "triton"])
@pytest.mark.parametrize("variant", ["llama-gqa4-hd64-untied", "qwen3-qknorm-gqa4-hd128",
                                     "qwen2-bias-gqa1-hd64-tied"])
def test_greedy_matches_transformers_in_bf16(variant, backend, checkpoint_factory, monkeypatch):
    """Chunked prefill (48 tokens a step) over cached prefixes, prompts arriving while others
    decode (mixed steps), a prompt sharing a cached 96-token prefix (a prefix-cache hit):
    flash-attn-4 runs every prefill part."""
    import transformers

    from tests.harness import Planes, completion
    from headrace.v1 import inference_pb2 as pb

    calls = []
    real = flash_attn4.paged_attention
    monkeypatch.setattr(flash_attn4, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = checkpoint_factory(variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=BF16).to(DEV).eval()
    rng = random.Random(11)
    shared = [rng.randrange(2, 384) for _ in range(100)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(rng.randrange(1, 80))] for _ in range(2)]
    prompts += [[rng.randrange(2, 384) for _ in range(n)] for n in (5, 150, 230)]
    prompts.append(shared + [rng.randrange(2, 384) for _ in range(40)])   # runs last, alone
    planes = Planes(path, num_kv_blocks=256, config=EngineConfig(max_batched_tokens=48),
                    worker_fields=dict(dtype="bfloat16", attention_backend=backend))
    def run(i: int):
        time.sleep(0.05 * i)   # staggered: later prompts join running ones (mixed steps)
        return planes.generate(prompt_token_ids=pb.TokenIds(ids=prompts[i]),
                               max_tokens=min(12, 255 - len(prompts[i])), ignore_eos=True,
                               logprobs=1, sampling=pb.SamplingParams(temperature=0))

    try:
        calls.clear()
        with concurrent.futures.ThreadPoolExecutor(len(prompts) - 1) as pool:
            results = list(pool.map(run, range(len(prompts) - 1)))
        results.append(run(len(prompts) - 1))   # alone: the shared prefix is cached by now
        agreed = []
        for prompt, responses in zip(prompts, results):
            ids, _, _ = completion(responses)
            lps = [lp.logprob for r in responses for lp in r.logprobs]
            ref_ids, ref_lps = _hf_greedy(hf, prompt, len(ids))
            agreed.append(_agree(ids, lps, ref_ids, ref_lps))
    finally:
        planes.close()
    assert sum(n >= 4 for n in agreed) >= len(prompts) // 2, agreed   # mostly no near-tie early
    assert (len(calls) > 0) == (backend == "flash-attn")
