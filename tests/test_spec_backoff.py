"""Speculation's back-off as the control plane runs it: a sequence with low acceptance pauses
and probes again, and a decode the worker would find no n-gram proposal for is never given
speculative positions (the control plane's n-gram index agrees with the worker's lookup), so
a batch with nothing to propose keeps its pipeline of steps in flight."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.common import speculative
from headrace.controlplane.engine.speculation import PROBE_TOKENS, Speculation
from headrace.dataplane.spec_decode import ngram_propose


class _Seq:
    def __init__(self, seq_id):
        self.seq_id, self.max_tokens, self.output_token_ids, self.num_inflight = seq_id, 100, [], 0
        self.num_total, self.in_prefill = 10, False
        self.prompt_token_ids = [1, 2] * 5   # its last 5 tokens occur before: a proposal
        self.sampling = _Sampling()


class _Sampling:
    repetition_penalty, presence_penalty, frequency_penalty, min_tokens = 1.0, 0.0, 0.0, 0
    stop_token_ids = ()
    logit_bias: dict = {}


def test_back_off_pauses_a_sequence_with_low_acceptance_and_probes_again():
    spec = Speculation(speculative.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                         '"disable_by_batch_size": 2}'), 1000)
    seq = _Seq(1)
    assert spec.active([seq]) and spec.positions(seq, 100) == 4
    rounds = 0
    while spec.positions(seq, 100):
        spec.observe(seq, 4, 4, 0)
        rounds += 1
    assert 1 < rounds < 10 and not spec.active([seq])
    for _ in range(PROBE_TOKENS - 1):
        assert spec.positions(seq, 100) == 0
    assert spec.active([seq]) and spec.positions(seq, 100) == 4   # the probe
    spec.observe(seq, 4, 4, 0)                                    # fails: a longer pause
    assert sum(spec.positions(seq, 100) == 0 for _ in range(2 * PROBE_TOKENS)) == 2 * PROBE_TOKENS
    assert not spec.active([_Seq(2), _Seq(3), _Seq(4)])           # more decodes than 2
    assert spec.positions(_Seq(5), 3) == 2                        # the token budget caps it


# -- no proposal, no speculation ----------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 3), st.integers(0, 4))
def test_the_control_plane_predicts_exactly_when_the_worker_proposes(tokens, lo, split):
    """``Speculation.proposes`` (an n-gram index grown token by token) agrees with the worker's
    lookup at every length, wherever the prompt ends."""
    cfg = speculative.parse(f'{{"method": "ngram", "num_speculative_tokens": 3, '
                            f'"prompt_lookup_min": {lo}, "prompt_lookup_max": {lo + 1}}}')
    spec, seq = Speculation(cfg, 1000), _Seq(1)
    seq.prompt_token_ids, seq.output_token_ids = tokens[:split + 1], []
    for t in tokens[split + 1:] + [None]:
        known = np.asarray(seq.prompt_token_ids + seq.output_token_ids)
        assert spec.proposes(seq) == bool(len(ngram_propose(known, 3, lo, lo + 1)))
        if t is not None:
            seq.output_token_ids.append(t)


def test_a_decode_without_a_proposal_does_not_speculate_nor_lose_acceptance():
    spec = Speculation(speculative.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                         '"prompt_lookup_min": 2}'), 1000)
    seq = _Seq(1)
    seq.prompt_token_ids = list(range(10))          # no 2-gram repeats
    assert not spec.active([seq]) and spec.positions(seq, 100) == 0
    spec.observe(seq, 0, 0, 0)                      # in a verify step without positions
    assert spec._state[1][0] == 1.0
    seq.output_token_ids = [8]                      # "9 8": no match yet
    assert not spec.active([seq])
    seq.output_token_ids = [8, 9]                   # "8 9" occurred, followed by a token
    assert spec.active([seq]) and spec.positions(seq, 100) == 4
    spec.forget(1)
    assert 1 not in spec._grams


def test_no_step_is_given_positions_for_which_the_worker_finds_no_drafts():
    """Random prompts, sampled: the worker is asked to speculate only where it proposes (each
    such step would run alone, the pipeline drained, for nothing)."""
    import asyncio
    import random

    from headrace.dataplane.default_model import default_model_dir
    from headrace.v1 import inference_pb2 as pb
    from tests.spec_harness import NGRAM, run, worker

    model, rng = str(default_model_dir()), random.Random(0)
    reqs = [dict(prompt_token_ids=pb.TokenIds(ids=rng.sample(range(2048), 40)), ignore_eos=True,
                 max_tokens=rng.randint(4, 24), sampling=pb.SamplingParams(temperature=1.0, seed=i))
            for i in range(12)]
    w = worker(model, dict(NGRAM, prompt_lookup_min=2))
    results, _ = asyncio.run(run(model, w, reqs))
    assert [len(r[0][0]) for r in results] == [r["max_tokens"] for r in reqs]
    assert w.runner.spec.num_unproposed == 0


def _propose_by_windows(tokens, k, lo, hi):
    """The lookup spelled out: every window of n tokens followed by a token, longest n first."""
    from numpy.lib.stride_tricks import sliding_window_view
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[n_tok - n:]).all(axis=1))
        if len(hits):
            return tokens[int(hits[0]) + n:int(hits[0]) + n + k]
    return tokens[:0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 5))
def test_the_fast_ngram_lookup_equals_the_windowed_one(tokens, lo, extra, k):
    arr = np.asarray(tokens, np.int32)
    assert ngram_propose(arr, k, lo, lo + extra).tolist() == _propose_by_windows(arr, k, lo, lo + extra).tolist()
