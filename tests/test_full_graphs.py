"""Full CUDA graphs of prefill and mixed steps (``--cudagraph-mode full``,
dataplane.full_graphs): one graph per bucket with the unified attention inside, its metadata
in static buffers padded past the step's sequences; padded tokens write no KV, steps beyond
the graphs run eagerly, and greedy outputs equal eager ones. On a CPU the graphs are the
stand-ins (tests/graphs.py) running the same body over the same static buffers (the attention
is the reference there; tests/test_unified_attention.py checks the Triton kernel); with
HEADRACE_TEST_DEVICE=cuda the worker captures real graphs and is compared with eager and
transformers."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from controlplane.engine import EngineConfig
from dataplane import graph_capture
from dataplane.forward import StepForward
from dataplane.full_graphs import FullGraphs
from dataplane.mixed_graphs import token_buckets
from tests import graphs
from tests.spec_harness import run
from tests.test_mixed_graphs import (CUDA, SPEC, _prep, _requests, _step, _worker,  # noqa: F401
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


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_outputs_with_full_graphs_equal_eager(model_dir, quantization):
    """Chunked prompts beside running decodes (max 48 tokens a step): prefill and mixed steps
    replay full graphs, decodes the decode graphs, and give eager's tokens and logprobs."""
    cfg = EngineConfig(max_running=8, max_batched_tokens=48)
    eager = _worker(model_dir, enforce_eager=True, quantization=quantization)
    reference, _ = asyncio.run(run(model_dir, eager, _requests(), cfg))
    w = _worker(model_dir, cudagraph_mode="full", quantization=quantization)
    g = graphs.attach(w, "full")
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(model_dir, w, _requests(), cfg))
    for a, b in zip(reference, out):
        for (ta, _, ra, la), (tb, _, rb, lb) in zip(a, b):
            assert (ta, ra) == (tb, rb)
            np.testing.assert_allclose([v for _, v in la], [v for _, v in lb], atol=1e-4)
    kinds = set(seen)
    assert {("mixed", "full"), ("prefill", "full"), ("decode", "full")} <= kinds
    assert not any(graph in ("eager", "piecewise") for _, graph in kinds), kinds
    assert g.mixed.num_replays > 0


@pytest.mark.skipif(not CUDA, reason="HEADRACE_TEST_DEVICE=cuda: real CUDA graphs")
@pytest.mark.parametrize("variant", ["llama-gqa4-hd64-untied", "qwen3-qknorm-gqa4-hd128"])
def test_gpu_full_graphs_equal_eager_and_transformers(variant, checkpoint_factory):
    import transformers

    path = str(checkpoint_factory(variant))
    cfg = EngineConfig(max_running=8, max_batched_tokens=48)
    eager, _ = asyncio.run(run(path, _worker(path, enforce_eager=True), _requests(), cfg))
    w = _worker(path, cudagraph_mode="full")
    assert isinstance(w.graphs.mixed, FullGraphs) and w.graphs.capture_seconds > 0
    assert 0 < w.graphs.estimated_bytes and 0 < w.graphs.measured_bytes
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(path, w, _requests(), cfg))
    assert {("mixed", "full"), ("decode", "full")} <= set(seen)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for req, a, b in zip(_requests(), eager, out):
        prompt = list(req["prompt_token_ids"].ids)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=req["max_tokens"], do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert a[0][0] == b[0][0] == ref


@pytest.mark.skipif(not (CUDA and os.environ.get("HEADRACE_TEST_QWEN3_DIR")),
                    reason="HEADRACE_TEST_DEVICE=cuda and HEADRACE_TEST_QWEN3_DIR")
def test_gpu_qwen3_0_6b_full_graphs_equal_eager():
    from headrace.v1 import inference_pb2 as pb

    path = os.environ["HEADRACE_TEST_QWEN3_DIR"]
    cfg = EngineConfig(max_running=64, max_batched_tokens=512)
    reqs = [dict(prompt_token_ids=pb.TokenIds(ids=[(31 * i + 7 * j) % 10000 for j in range(40 + 37 * i)]),
                 max_tokens=24, ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0))
            for i in range(24)]
    opts = dict(num_kv_blocks=2048, block_size=16, max_num_seqs=64, max_batched_tokens=512)
    eager, _ = asyncio.run(run(path, _worker(path, enforce_eager=True, **opts), reqs, cfg))
    w = _worker(path, cudagraph_mode="full", **opts)
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(path, w, reqs, cfg))
    assert ("mixed", "full") in set(seen)
    assert [a[0][0] for a in eager] == [b[0][0] for b in out]
