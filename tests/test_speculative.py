"""Speculative decoding (n-gram): the config as vLLM spells it, the proposer, exactness of
greedy output against speculation off (prefix hits, chunked prefill, preemption, n > 1, stop
strings and tokens, max_tokens boundaries, logprobs) with acceptance actually measured, the
rejection rule's distribution (chi-square), back-off, metrics, and no leaked blocks after
random cancels."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from scipy import stats

from headrace.common import speculative
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.metrics import ControlPlaneMetrics
from headrace.controlplane.engine.speculation import Speculation
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.sampler import SamplingBatch, sample
from headrace.dataplane.spec_decode import ngram_propose, verify
from headrace.v1 import inference_pb2 as pb
from tests.spec_harness import NGRAM, run, worker

MODEL = str(default_model_dir())
PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good "
           "fortune, must be in want of a wife. ")
GREEDY = pb.SamplingParams(temperature=0.0)


# -- configuration ----------------------------------------------------------------------------
def test_config_follows_vllm_spelling_and_defaults():
    cfg = speculative.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)   # vLLM's default
    cfg = speculative.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    assert speculative.parse(None) is None and speculative.parse("") is None


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"), ("[1]", "JSON object"), ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "unknown keys"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "min >"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance": 2}', "min_acceptance"),
])
def test_bad_config_is_rejected_with_a_clear_message(text, message):
    with pytest.raises(ValueError, match=message):
        speculative.parse(text)


def test_the_worker_reports_its_config_and_the_cli_parses_it():
    from headrace.cli.main import build_parser, main

    with pytest.raises(SystemExit, match="unknown keys"):
        main(["dataplane", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'])

    args = build_parser().parse_args(["dataplane", "--speculative-config", '{"method": "ngram", '
                                      '"num_speculative_tokens": 2}'])
    assert speculative.parse(args.speculative_config).num_speculative_tokens == 2
    info = worker(MODEL, NGRAM).describe()
    assert speculative.from_proto(info.speculative) == speculative.parse(str(NGRAM).replace("'", '"'))
    assert not worker(MODEL, None).describe().speculative.method


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert ngram_propose(t, 3, 1, 3).tolist() == [4, 9, 2]      # "1 2 3" matches at 0
    assert ngram_propose(t, 2, 1, 2).tolist() == [4, 9]         # "2 3": first occurrence
    assert ngram_propose(np.array([1, 2, 3]), 2, 1, 3).tolist() == []
    assert ngram_propose(np.array([5, 6, 5]), 4, 1, 2).tolist() == [6, 5]   # up to the end


# -- exactness --------------------------------------------------------------------------------
def _requests() -> list[dict]:
    doc = PASSAGE * 3
    return [
        dict(prompt=doc, max_tokens=32, ignore_eos=True, sampling=GREEDY, logprobs=2),
        dict(prompt=doc, max_tokens=23, ignore_eos=True, sampling=GREEDY),          # prefix hit
        dict(prompt=doc + "Mr. Bennet", max_tokens=1, ignore_eos=True, sampling=GREEDY),
        dict(prompt=doc + "She", max_tokens=17, n=2, ignore_eos=True, sampling=GREEDY),
        dict(prompt=PASSAGE + PASSAGE[:40], max_tokens=30, ignore_eos=True, sampling=GREEDY,
             stop=["in the world"]),
        dict(prompt=doc + "But", max_tokens=30, ignore_eos=True, sampling=GREEDY,
             stop_token_ids=[408]),
        dict(prompt=doc + "But", max_tokens=12, ignore_eos=True, sampling=GREEDY, min_tokens=4,
             stop_token_ids=[545, 408]),
        dict(prompt=PASSAGE * 2, max_tokens=16, ignore_eos=True, sampling=pb.SamplingParams(
            temperature=0.9, seed=11)),
    ]


def _completions(results):
    return [[(tokens, text, reason, lps) for tokens, text, reason, lps in r] for r in results]


def _assert_same(off, on):
    for a, b in zip(off, on):
        for (ta, xa, ra, la), (tb, xb, rb, lb) in zip(a, b):
            assert (ta, xa, ra) == (tb, xb, rb)
            assert [t for t, _ in la] == [t for t, _ in lb]
            assert np.allclose([v for _, v in la], [v for _, v in lb], atol=2e-3)


def test_greedy_output_with_speculation_is_identical_to_without():
    """One run each way through a tight pool (preemption) with a small token budget (chunked
    prefill) and shared prompts (prefix hits)."""
    blocks, budget = 44, 48
    cfg = EngineConfig(max_running=16, max_batched_tokens=budget)
    reqs = _requests()
    off, _ = asyncio.run(run(MODEL, worker(MODEL, None, num_kv_blocks=blocks, max_batched_tokens=budget), reqs, cfg))
    on, engine = asyncio.run(run(MODEL, worker(MODEL, NGRAM, num_kv_blocks=blocks, max_batched_tokens=budget),
                                 reqs, cfg))
    _assert_same(_completions(off), _completions(on))
    spec, sched = engine.scheduler.speculation, engine.scheduler
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert off[4][0][2] == pb.FINISH_REASON_STOP_STRING and off[5][0][2] == pb.FINISH_REASON_STOP
    assert sched.num_preemptions > 0 and sched.blocks.prefix_hits > 0
    assert sched.blocks.num_free == sched.blocks.num_blocks and not any(sched.blocks.ref)


def test_no_blocks_leak_after_random_cancels():
    rng = random.Random(3)
    reqs = [dict(prompt=PASSAGE + str(i), max_tokens=20, ignore_eos=True, sampling=GREEDY)
            for i in range(6)]
    aborts = {i: rng.randint(1, 12) for i in rng.sample(range(6), 4)}
    _, engine = asyncio.run(run(MODEL, worker(MODEL, NGRAM, num_kv_blocks=60), reqs,
                                abort_after=aborts))
    blocks = engine.scheduler.blocks
    assert engine.scheduler.speculation.num_drafts > 0
    assert blocks.num_free == blocks.num_blocks and not any(blocks.ref)


# -- the rejection rule -----------------------------------------------------------------------
def _rows(n: int, temperature: float, seeded: bool) -> SamplingBatch:
    return SamplingBatch(np.full(n, temperature, np.float32), np.zeros(n, np.int64),
                         np.ones(n, np.float32), np.zeros(n, np.float32),
                         np.arange(n, dtype=np.int64), np.full(n, seeded), np.zeros(n, np.int64),
                         np.zeros(n, np.int64), [])


@pytest.mark.parametrize("draft, seeded", [(0, False), (3, False), (1, True)])
def test_emitted_tokens_follow_the_target_distribution(draft, seeded):
    """k = 1: position 0 verifies ``draft``, position 1 is the bonus. The first emitted token
    must follow p0 whatever the draft, the second (after an accept) p1."""
    n, vocab = 20000, 5
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    logits = torch.stack([p0.log(), p1.log()]).repeat(n, 1)   # rows: (seq 0 pos 0, pos 1, ...)
    b = _rows(2 * n, 1.0, seeded)
    b.num_output = np.tile([0, 1], n)
    if seeded:
        b.seed = np.repeat(np.arange(n, dtype=np.int64), 2)
    y = sample(logits, b, rng=np.random.default_rng(0)).token_ids
    index = torch.arange(2 * n).view(n, 2)
    accepted, last = verify(y, index, torch.full((n, 1), draft))
    first = torch.where(accepted == 1, torch.full_like(last, draft), last)
    counts = torch.bincount(first, minlength=vocab).numpy()
    expected = lambda p, total: p.double().numpy() / p.double().sum().item() * total  # noqa: E731
    assert stats.chisquare(counts, expected(p0, counts.sum())).pvalue > 1e-3
    assert abs(accepted.float().mean().item() - p0[draft].item()) < 0.02
    bonus = torch.bincount(last[accepted == 1], minlength=vocab).numpy()
    assert stats.chisquare(bonus, expected(p1, bonus.sum())).pvalue > 1e-3


def test_greedy_accepts_exactly_the_matching_prefix():
    y = torch.tensor([4, 7, 2, 9, 5, 5])
    index = torch.tensor([[0, 1, 2, 3], [4, 5, 5, 5]])
    drafts = torch.tensor([[4, 7, 3], [6, -1, -1]])
    accepted, last = verify(y, index, drafts)
    assert accepted.tolist() == [2, 0] and last.tolist() == [2, 5]


# -- back-off and metrics -----------------------------------------------------------------------
def test_large_batches_do_not_speculate_and_metrics_are_exported():
    reqs = [dict(prompt=PASSAGE * 2 + str(i), max_tokens=8, ignore_eos=True, sampling=GREEDY)
            for i in range(4)]
    cfg = dict(NGRAM, disable_by_batch_size=2)
    _, engine = asyncio.run(run(MODEL, worker(MODEL, cfg), reqs))
    assert engine.scheduler.speculation.num_drafts == 0   # 4 decodes run until the end
    _, engine = asyncio.run(run(MODEL, worker(MODEL, NGRAM), reqs))
    assert engine.scheduler.speculation.num_drafts > 0
    metrics = ControlPlaneMetrics()
    metrics.bind(engine)
    names = {s.name: s for m in metrics.registry.collect() for s in m.samples}
    spec = engine.scheduler.speculation
    assert names["headrace:spec_decode_num_accepted_tokens_total"].value == spec.num_accepted_tokens
    assert names["headrace:spec_decode_num_draft_tokens_total"].value == spec.num_draft_tokens
    assert names["headrace:spec_decode_num_drafts_total"].value == spec.num_drafts
    assert "headrace:spec_decode_num_accepted_tokens_per_pos_total" in names


# -- the scheduler's side ---------------------------------------------------------------------
def _spec_sched(blocks: int, max_tokens: int = 50):
    from tests.test_scheduler import make_request, run_step, sched_of

    sched = sched_of(blocks=blocks, bs=4, budget=64)
    sched.speculation = Speculation(speculative.parse('{"method": "ngram", "num_speculative_tokens": 4}'), 1000)
    req = make_request([7] * 6, max_tokens=max_tokens)   # sampled: 7 (the n-gram lookup matches)
    req.sequences[0].sampling.repetition_penalty = 1.0   # as validation fills it in
    sched.add(req.sequences)
    run_step(sched)   # prefill: one token sampled
    return sched, req.sequences[0]


def test_a_speculating_decode_is_budgeted_k_plus_one_and_rolls_back_rejected_blocks():
    sched, seq = _spec_sched(blocks=20)
    assert seq.num_computed == 6 and seq.num_total == 7 and len(sched.blocks.block_ids(seq.seq_id)) == 2
    assert sched.may_speculate()
    step = sched.schedule(speculate=True)
    assert step.speculative and step.running.num_spec == [4] and step.running.num_tokens == [1]
    assert len(sched.blocks.block_ids(seq.seq_id)) == 3 == 2 + step.running.new_block_counts[0]  # 11 slots
    sched.after_step(step)
    cached_before = len(sched.blocks.cached)
    seq.num_inflight -= 1
    seq.output_token_ids += [7, 7]   # one draft accepted, then the target's token
    sched.verified(seq, 4, 4, 1)
    assert seq.num_computed == 8 and seq.num_total == 9
    assert len(sched.blocks.block_ids(seq.seq_id)) == 3                  # 9 tokens need 3 blocks
    assert len(sched.blocks.cached) == cached_before + 1                 # tokens 4..7 verified
    step = sched.schedule(speculate=True)   # 8 + 1 + 4 = 13 slots: 4 blocks
    assert step.running.num_spec == [4] and len(sched.blocks.block_ids(seq.seq_id)) == 4
    sched.after_step(step)
    seq.num_inflight -= 1
    seq.output_token_ids.append(7)     # nothing accepted: only the target's token
    sched.verified(seq, 4, 4, 0)
    assert len(sched.blocks.block_ids(seq.seq_id)) == 3                  # the 4th block goes back
    nxt = sched.schedule()
    assert nxt.truncations == [(seq.seq_id, 3)]
    assert sched.speculation.num_draft_tokens == 8 and sched.speculation.accepted_per_pos[0] == 1


def test_speculative_positions_never_preempt_and_respect_max_tokens():
    sched, seq = _spec_sched(blocks=3)           # 2 blocks held, 1 free: 12 slots in all
    step = sched.schedule(speculate=True)
    assert step.running.num_spec == [4] and sched.blocks.num_free == 0
    sched.after_step(step)
    seq.num_inflight -= 1
    seq.output_token_ids += [7, 7, 7, 7]           # 3 accepted: 11 tokens, 10 computed
    sched.verified(seq, 4, 4, 3)
    step = sched.schedule(speculate=True)           # 1 slot left beyond the next token
    assert step.running.num_spec == [1] and sched.num_preemptions == 0
    sched2, seq2 = _spec_sched(blocks=20, max_tokens=3)
    assert sched2.schedule(speculate=True).running.num_spec == [1]   # 1 sampled, 1 + 1 left


def test_the_worker_cuts_accepted_drafts_after_a_stop_token_and_rewinds_its_mirror():
    from headrace.dataplane.input_batch import InputBatch
    from headrace.dataplane.sampler import SamplingRow
    from headrace.dataplane.spec_decode import SpecDecoder, Verified
    from headrace.worker.v1 import worker_pb2 as wpb

    def state(stops):
        return SamplingRow(0.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None, 0, 0, stops, [1, 2, 3, 1, 2], [])

    batch = InputBatch(4, 64, 4, 16, keep_tokens=True)
    a, b = batch.add(7, state([3]), [0, 1], 4), batch.add(8, state([]), [2, 3], 4)
    spec = SpecDecoder(speculative.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'))
    rows = np.array([a, b])
    drafts = spec.propose(batch, rows, np.array([3, 3]))
    assert drafts.tolist() == [3, 3] and batch.tokens[a, 5:8].tolist() == [3, 1, 2]   # "1 2" -> 3 1 2
    prep = batch.prepare(rows, 1 + drafts, drafts)
    SpecDecoder.unpropose(batch, rows, drafts)
    batch.count_sampled(prep.sample_rows)
    assert prep.logits_indices.tolist() == list(range(8)) and prep.max_query_len == 4
    arrays = spec.verify_arrays(prep)
    y = torch.tensor([3, 9, 0, 0, 3, 1, 7, 0])
    accepted, last = verify(y, torch.from_numpy(arrays["spec_index"]), torch.from_numpy(arrays["spec_drafts"]))
    assert accepted.tolist() == [1, 2] and last.tolist() == [9, 7]
    v = Verified(prep.sample_rows, prep.num_drafts, np.array([0, 0]), accepted)
    result = wpb.StepResult()
    SpecDecoder.finish(batch, v, [7, 8], y.tolist(), None, None, None, result)
    # row a accepted 3 then drew 9, but 3 is its stop token: 9 is dropped
    assert list(result.num_tokens) == [1, 3] and list(result.token_ids) == [3, 3, 1, 7]
    assert list(result.num_draft_tokens) == [3, 3]
    assert list(result.stopped_seq_ids) == [7] and 7 in batch.stopped
    assert batch.num_tokens[b] == 8 and batch.num_computed[b] == 7
    assert batch.tokens[b, :8].tolist() == [1, 2, 3, 1, 2, 3, 1, 7]

