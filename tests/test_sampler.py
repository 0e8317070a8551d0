"""The sampler: greedy, filters, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from headrace.dataplane.sampler import SamplingBatch, SamplingRow
from headrace.dataplane.sampler import sample as sample_batch


class Sampled:
    def __init__(self, out):
        self.token_ids, self.logprobs, self.top_token_ids, self.top_logprobs = out.to_host()


def sample(logits, rows):
    return Sampled(sample_batch(logits, SamplingBatch.of_rows(rows)))


def row(**kw) -> SamplingRow:
    base = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, seed=None, logprobs=0, min_tokens=0,
                stop_token_ids=[], prompt_token_ids=[1], output_token_ids=[])
    base.update(kw)
    return SamplingRow(**base)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits.clone(), [row(), row()]).token_ids == [1, 0]


def test_top_k_1_and_tiny_top_p_are_greedy_even_when_sampling():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1).tolist()
    assert sample(logits.clone(), [row(temperature=1.0, top_k=1)] * 4).token_ids == best
    assert sample(logits.clone(), [row(temperature=1.0, top_p=1e-6)] * 4).token_ids == best
    assert sample(logits.clone(), [row(temperature=1.0, min_p=1.0)] * 4).token_ids == best


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(4000, 1)
    toks = torch.tensor(sample(logits, [row(temperature=1.0)] * 4000).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_top_k_restricts_support():
    torch.manual_seed(1)
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, 0.0]]).repeat(500, 1)
    toks = set(sample(logits, [row(temperature=5.0, top_k=2)] * 500).token_ids)
    assert toks == {0, 1}


def test_seed_gives_the_same_tokens_whatever_the_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seeded = row(temperature=1.0, seed=42, output_token_ids=[5, 6])
    a = sample(logits.clone(), [seeded, row(temperature=1.0), row()]).token_ids[0]
    b = sample(logits[[0]].clone(), [seeded]).token_ids[0]
    c = sample(torch.cat([logits[[1]], logits[[0]]]).clone(), [row(temperature=2.0), seeded]).token_ids[1]
    assert a == b == c


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]])
    # repetition penalty divides positive logits of seen tokens: token 0 drops below 1
    out = sample(logits.clone(), [row(repetition_penalty=2.0, prompt_token_ids=[0])])
    assert out.token_ids == [1]
    out = sample(logits.clone(), [row(frequency_penalty=0.2, output_token_ids=[0, 0, 1])])
    assert out.token_ids == [3]
    out = sample(logits.clone(), [row(presence_penalty=0.5, output_token_ids=[0, 1])])
    assert out.token_ids == [3]


def test_logit_bias_is_added_before_penalties_and_filters_and_logprobs_stay_the_models():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    biased = row(bias_ids=[3, 0], bias_values=[100.0, -100.0], logprobs=1)
    assert biased.uses_history   # edited row by row: eager sampling, no speculation
    out = sample(logits.clone(), [biased, row()])
    assert out.token_ids == [3, 0]   # the neighbour is untouched
    made = biased.bias_tensors(logits.device)
    assert sample(logits.clone(), [biased, row()]).token_ids == [3, 0]
    assert biased.bias_tensors(logits.device) is made   # made once a row, not every step
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    # a banned token is never sampled, at any temperature; a bias moves top-k's cut
    banned = row(temperature=5.0, bias_ids=[0, 1], bias_values=[-100.0, -100.0], seed=3)
    assert all(t in (2, 3) for t in sample(logits[:1].repeat(64, 1), [banned] * 64).token_ids)
    top1 = row(temperature=1.0, top_k=1, bias_ids=[2], bias_values=[2.5])
    assert sample(logits[:1].clone(), [top1]).token_ids == [2]
    # before the penalties: a bias past a repetition penalty's division
    rep = row(repetition_penalty=4.0, prompt_token_ids=[1], bias_ids=[1], bias_values=[3.0])
    assert sample(logits[:1].clone(), [rep]).token_ids == [0]   # (1 + 3) / 4 = 1 < 2


def test_min_tokens_suppresses_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert sample(logits.clone(), [row(min_tokens=2, stop_token_ids=[0])]).token_ids == [1]
    done = row(min_tokens=2, stop_token_ids=[0], output_token_ids=[1, 1])
    assert sample(logits.clone(), [done]).token_ids == [0]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = sample(logits.clone(), [row(logprobs=2, temperature=0.5), row()])
    expect = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1)
    assert out.top_token_ids[0] == [2, 1] and out.top_token_ids[1] == []
    assert out.top_logprobs[0] == pytest.approx(expect[[2, 1]].tolist())
    assert out.logprobs[1] == pytest.approx(math.log(1 / 3))


def test_seeded_noise_follows_the_distribution_and_depends_on_the_counter():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(3000, 1)
    rows = [row(temperature=1.0, seed=s) for s in range(3000)]
    toks = torch.tensor(sample(logits.clone(), rows).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 3000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    one = [row(temperature=1.0, seed=7, output_token_ids=[1] * k) for k in range(200)]
    assert len(set(sample(probs.log().repeat(200, 1), one).token_ids)) == 3
