"""Speculative verifies replayed in the decode CUDA graphs: a verify of decodes only becomes one
decode row per verified token (its own context length, its sequence's block table), prefill steps
(and verifies beside prefill chunks) replay the piecewise graphs, and greedy output is identical to
speculation off with the verify graphs actually replayed. On CPU the graphs are
``cuda_graphs.EagerGraph`` stand-ins over the same static buffers; with HEADRACE_TEST_DEVICE=cuda
the worker captures real CUDA graphs (fp32)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from headrace.common import speculative
from headrace.controlplane.engine.loop import EngineConfig
from headrace.dataplane.cuda_graphs import EagerGraph
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.input_batch import InputBatch
from headrace.dataplane.sampler import SamplingRow
from headrace.dataplane.spec_decode import SpecDecoder, decode_rows, graph_rows
from headrace.v1 import inference_pb2 as pb
from tests.graphs import attach, record_modes
from tests.spec_harness import NGRAM, run, worker

MODEL = str(default_model_dir())
CUDA = os.environ.get("HEADRACE_TEST_DEVICE", "cpu").startswith("cuda")
PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good "
           "fortune, must be in want of a wife. ")
GREEDY = pb.SamplingParams(temperature=0.0)


def _state(prompt):
    return SamplingRow(0.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None, 0, 0, [], list(prompt), [])


def test_graph_rows_cover_every_speculating_decode():
    cfg = speculative.parse('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 32}')
    assert graph_rows(None, 256) == 256 and graph_rows(cfg, 256) == 256
    assert graph_rows(cfg, 16) == 80 and graph_rows(cfg, 64) == 160


def test_a_verify_of_decodes_becomes_one_decode_row_per_token():
    batch = InputBatch(4, 64, 4, 16, keep_tokens=True)
    a = batch.add(1, _state([1, 2, 3, 1, 2]), [0, 1], 4)
    b = batch.add(2, _state([5, 6, 7, 8, 9, 4]), [2, 3], 5)
    spec = SpecDecoder(speculative.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'))
    rows = np.array([a, b])
    drafts = spec.propose(batch, rows, np.array([3, 3]))
    assert drafts.tolist() == [3, 0]          # b's last token never occurred before
    prep = batch.prepare(rows, 1 + drafts, drafts)
    out = decode_rows(prep)
    # b (one token) runs first in the mixed order, then a's 4 tokens at positions 4..7
    assert prep.positions.tolist() == [5, 4, 5, 6, 7]
    assert out["seq_lens"].tolist() == [6, 5, 6, 7, 8]
    assert out["block_tables"].tolist() == [[2, 3], [0, 1], [0, 1], [0, 1], [0, 1]]
    assert sorted(out["decode_order"].tolist()) == list(range(5)) and out["decode_order"][0] == 4
    assert prep.logits_indices.tolist() == list(range(5))


def test_a_verify_beside_a_prefill_chunk_stays_eager():
    batch = InputBatch(4, 64, 4, 16, keep_tokens=True)
    a = batch.add(1, _state([1, 2, 3, 1, 2]), [0, 1], 4)
    c = batch.add(3, _state(list(range(10, 20))), [4, 5, 6], 0)
    spec = SpecDecoder(speculative.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'))
    rows = np.array([a, c])
    drafts = spec.propose(batch, rows, np.array([3, 0]))
    prep = batch.prepare(rows, np.array([1, 6]) + drafts, drafts)   # c: a chunk of its prompt
    assert prep.num_drafts is not None and decode_rows(prep) is None
    batch2 = InputBatch(4, 64, 4, 16)
    r = batch2.add(1, _state([1, 2, 3]), [0], 2)
    assert decode_rows(batch2.prepare(np.array([r]), np.array([1]))) is None   # not a verify


def _requests() -> list[dict]:
    doc = PASSAGE * 3
    return [dict(prompt=doc, max_tokens=40, ignore_eos=True, sampling=GREEDY, logprobs=2),
            dict(prompt=doc + "She", max_tokens=24, n=2, ignore_eos=True, sampling=GREEDY),
            dict(prompt=PASSAGE + "But", max_tokens=30, ignore_eos=True, sampling=GREEDY,
                 stop_token_ids=[408])]


def _graphed(w):
    """The worker's decode graphs (with the piecewise graphs of prefill and mixed steps beside
    them: the CPU stand-ins unless the worker has real ones)."""
    return attach(w).decode


# the embedded model as its own draft: every greedy draft must be accepted, which holds only
# if the draft's KV follows the target's through graph replays (one decode row per token)
SELF_DRAFT = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4}


@pytest.mark.slow   # every graph size, twice
@pytest.mark.parametrize("config", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_greedy_output_with_verify_graphs_is_identical_to_without_speculation(config):
    opts = dict(device="cuda", cuda_graphs=True) if CUDA else {}
    cfg = EngineConfig(max_running=16, max_batched_tokens=64)
    reqs = _requests()
    w_off = worker(MODEL, None, max_batched_tokens=64, **opts)
    g_off = _graphed(w_off)
    off, _ = asyncio.run(run(MODEL, w_off, reqs, cfg))
    w_on = worker(MODEL, config, max_batched_tokens=64, **opts)
    graphs = _graphed(w_on)
    assert isinstance(graphs.graphs[1], EagerGraph) != CUDA
    seen = record_modes(w_on.runner)
    on, engine = asyncio.run(run(MODEL, w_on, reqs, cfg))
    for a, b in zip(off, on):
        for (ta, xa, ra, la), (tb, xb, rb, lb) in zip(a, b):
            assert (ta, xa, ra) == (tb, xb, rb)
            assert [t for t, _ in la] == [t for t, _ in lb]
            assert np.allclose([v for _, v in la], [v for _, v in lb], atol=2e-3)
    spec = engine.scheduler.speculation
    assert spec.num_accepted_tokens > 0
    assert g_off.num_replays > 0 and g_off.num_verify_replays == 0
    assert graphs.num_verify_replays > 0   # the verifies were replayed, not run eagerly
    # ... and the prefill steps piecewise (a verify beside a prefill chunk too: test_mixed_graphs)
    assert ("prefill", "piecewise") in seen and not any(mode == "eager" for _, mode in seen)
    if config is SELF_DRAFT:   # stops and max_tokens cut a few accepted drafts, nothing else
        assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
        assert w_on.runner.draft.graphs.num_replays > 0   # proposals and syncs replayed graphs
    print(f"verify replays {graphs.num_verify_replays} of {graphs.num_replays}; accepted "
          f"{spec.num_accepted_tokens} of {spec.num_draft_tokens} drafts")


@pytest.mark.skipif(not CUDA, reason="HEADRACE_TEST_DEVICE=cuda: real CUDA graphs")
def test_the_worker_captures_graphs_for_verify_rows():
    w = worker(MODEL, NGRAM, device="cuda", cuda_graphs=True)
    assert w.runner.graphs is not None and w.runner.graphs.max_batch == graph_rows(w.speculative, 16)
