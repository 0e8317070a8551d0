"""Full CUDA graphs of prefill and mixed steps (``--cudagraph-mode full``,
headrace.dataplane.full_graphs): one graph per bucket with the unified attention inside, its
metadata in static buffers padded past the step's sequences; padded tokens write no KV, steps beyond
the graphs run eagerly. On a CPU the graphs are the stand-ins (tests/graphs.py) running the same
body over the same static buffers (the attention is the reference there;
tests/test_unified_attention.py checks the Triton kernel). Greedy outputs equal eager ones on the
stand-ins and, on a GPU, real graphs equal eager and transformers: tests/test_mixed_graphs.py runs
those tests in every step-graph mode."""

from __future__ import annotations

import numpy as np
import torch

from headrace.dataplane import graph_capture
from headrace.dataplane.forward import StepForward
from headrace.dataplane.full_graphs import FullGraphs
from headrace.dataplane.mixed_graphs import token_buckets
from tests import graphs
from tests.test_mixed_graphs import (SPEC, _prep, _step, _worker,  # noqa: F401
                                     _written_slots, compare_steps, model_dir,  # (a fixture)
                                     verify_beside_chunk)


def test_full_mode_captures_decode_graphs_and_one_graph_per_bucket(model_dir):
    w = _worker(model_dir)
    full = graph_capture.WorkerGraphs("full", w.runner.model, w.device, 8, 16, 48)
    assert isinstance(full.mixed, FullGraphs) and full.mixed.logits is full.decode.logits
    assert full.num_graphs == len(full.decode.sizes) + len(token_buckets(48)) + 4
    meta = full.mixed.meta.numel() * 4 + full.mixed.block_tables.numel() * 4
    logits = full.decode.logits.numel() * full.decode.logits.element_size()
    assert full.static_bytes() == full.decode.static_bytes() + full.mixed.static_bytes() - logits
    assert full.mixed.static_bytes() == (full.mixed.rows.numel() * 8 + meta + logits
                                         + full.mixed.sampled.numel() * full.mixed.sampled.element_size())
    full.capture(w.runner.kv_caches)
    assert "full graph" in full.describe()


def test_steps_the_full_graphs_cannot_hold_run_eagerly(model_dir):
    w = _worker(model_dir, cudagraph_mode="full")
    g = graphs.attach(w, "full")
    fwd = StepForward(w.runner.model, w.runner.kv_caches, w.device, 8, g.decode, g.mixed)
    decode = _prep(8, 8, decode_only=True)
    assert fwd.mode(decode) == "full" and not fwd._step_graphs(decode, "full")   # decode graphs
    mixed = _prep(48, 3)
    assert fwd.mode(mixed) == "full" and fwd._step_graphs(mixed, "full")
    assert fwd.mode(_prep(49, 3)) == "eager"     # more tokens than the largest bucket
    assert fwd.mode(_prep(40, 9)) == "eager"     # more sampled rows than the LM-head graphs hold
    many = _prep(40, 3)
    many.seq_lens = np.zeros(9)                  # more sequences than the static metadata holds
    assert fwd.mode(many) == "eager"


def test_metadata_is_padded_past_the_steps_sequences(model_dir):
    w = _worker(model_dir)
    g = FullGraphs(w.runner.model, [], 48, 8, 6, 16, w.device)
    prep = _prep(11, 2)
    prep.query_start_loc = np.array([0, 1, 4, 11], dtype=np.int32)
    prep.seq_lens = np.array([9, 4, 20], dtype=np.int32)
    meta = g.meta_arrays(prep)["graph_meta"]
    assert meta.tolist() == [[0, 1, 4, 11, 11, 11, 11], [9, 4, 20, 0, 0, 0, 0]]


def test_padded_tokens_write_no_kv_and_logits_match_eager(model_dir):
    eager = _worker(model_dir, num_kv_blocks=16, enforce_eager=True)
    full = _worker(model_dir, num_kv_blocks=16, cudagraph_mode="full")
    g = graphs.attach(full, "full")
    steps = [_step(1, new=[(1, [5, 6, 7, 8, 9], [0, 1]), (2, [3, 4, 5, 6, 7, 8], [2, 3])]),
             _step(2, new=[(3, [11, 12, 13, 14, 15, 16, 17], [4, 5])], running=[(1, []), (2, [])]),
             _step(3, running=[(1, []), (2, []), (3, [])])]
    seen = compare_steps(eager, full, steps)
    assert seen == [("prefill", "eager"), ("prefill", "full"), ("mixed", "eager"), ("mixed", "full"),
                    ("decode", "eager"), ("decode", "full")]
    assert g.mixed.num_replays == 2 and g.decode.num_replays == 1   # the decode step: decode graphs
    assert g.mixed.query_start_loc.tolist()[:4] == [0, 1, 2, 9]     # step 2's, then padding
    assert set(g.mixed.query_start_loc.tolist()[4:]) == {9}
    assert _written_slots(full.runner.kv_caches) == _written_slots(eager.runner.kv_caches)
    for ca, cb in zip(eager.runner.kv_caches, full.runner.kv_caches):
        torch.testing.assert_close(ca, cb, atol=1e-5, rtol=1e-5)


def test_a_verify_beside_a_prefill_chunk_replays_the_full_graph_as_eager_runs_it(model_dir):
    workers = [_worker(model_dir, enforce_eager=True, speculative_config=SPEC),
               _worker(model_dir, cudagraph_mode="full", speculative_config=SPEC)]
    graphs.attach(workers[1], "full")
    results, modes = verify_beside_chunk(workers)
    assert modes == [("prefill", "eager"), ("verify", "eager"), ("prefill", "full"), ("verify", "full")]
    for field in ("seq_ids", "token_ids", "num_tokens", "num_draft_tokens"):
        assert list(getattr(results[1], field)) == list(getattr(results[3], field)), field

