"""Piecewise CUDA graphs of prefill and mixed steps (headrace.dataplane.mixed_graphs): buckets cover
every step size, padded tokens write no KV, the LM head sees the sampled rows only, steps the graphs
cannot hold run eagerly, and greedy outputs equal the eager ones. On a CPU the graphs are the
stand-ins (tests/graphs.py); with HEADRACE_TEST_DEVICE=cuda the worker captures real graphs
(float32: bit-for-bit equal kernels but for the padding), piecewise and full
(tests/test_full_graphs.py), and the outputs are compared with eager and with transformers."""

from __future__ import annotations

import asyncio
import os
import types

import numpy as np
import pytest
import torch

from headrace.controlplane.engine.loop import EngineConfig
from headrace.dataplane import graph_capture
from headrace.dataplane.forward import StepForward
from headrace.dataplane.mixed_graphs import token_buckets
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb
from tests import graphs
from tests.checkpoints import make_checkpoint
from tests.spec_harness import run

CUDA = os.environ.get("HEADRACE_TEST_DEVICE", "cpu").startswith("cuda")
GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", heads=4, kv_heads=2,
                               head_dim=32))


def _worker(model_dir, **options) -> Worker:
    opts = dict(model=model_dir, device="cuda" if CUDA else "cpu", dtype="float32",
                num_kv_blocks=96, block_size=4, max_num_seqs=8, max_batched_tokens=48)
    return Worker(WorkerOptions(**(opts | options)))


@pytest.mark.parametrize("max_tokens", [1, 7, 64, 256, 300, 2048, 5000])
def test_buckets_cover_every_step_size_with_little_padding(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        size = next(s for s in buckets if s >= n)
        assert size - n < (16 if n <= 256 else n / 8 + 1), (n, size)


def test_mode_flags_resolve_and_bad_ones_fail_with_the_flag_named(model_dir):
    def opts(**kw):
        return WorkerOptions(model=model_dir, **kw)

    assert graph_capture.resolve_mode(opts()) == "full_and_piecewise"
    assert graph_capture.resolve_mode(opts(enforce_eager=True)) == "none"
    assert graph_capture.resolve_mode(opts(cuda_graphs=False, cudagraph_mode="piecewise")) == "none"
    assert graph_capture.resolve_mode(opts(cudagraph_mode="full_decode_only")) == "full_decode_only"
    assert graph_capture.capture_tokens(opts()) == 2048
    assert graph_capture.capture_tokens(opts(max_batched_tokens=16384)) == 4096
    assert graph_capture.capture_tokens(opts(max_cudagraph_capture_size=512)) == 512
    assert graph_capture.resolve_mode(opts(cudagraph_mode="full")) == "full"
    with pytest.raises(ValueError, match="--cudagraph-mode 'fully'"):
        _worker(model_dir, cudagraph_mode="fully")
    with pytest.raises(ValueError, match="--max-cudagraph-capture-size 0"):
        _worker(model_dir, max_cudagraph_capture_size=0)


def test_graph_memory_counts_the_shared_logits_once(model_dir):
    w = _worker(model_dir)
    both = graph_capture.WorkerGraphs("full_and_piecewise", w.runner.model, w.device, 8, 16, 48)
    assert both.mixed.logits is both.decode.logits
    logits = both.decode.logits.numel() * both.decode.logits.element_size()
    assert both.static_bytes() == both.decode.static_bytes() + both.mixed.static_bytes() - logits
    assert both.reserve_bytes(1000) == 1000 and both.estimated_bytes == both.static_bytes() + 1000
    none = graph_capture.WorkerGraphs("none", w.runner.model, w.device, 8, 16, 48)
    assert none.num_graphs == 0 and none.reserve_bytes(1000) == 0 and none.static_bytes() == 0
    piecewise = graph_capture.WorkerGraphs("piecewise", w.runner.model, w.device, 8, 16, 48)
    assert piecewise.decode is None and piecewise.num_graphs == len(token_buckets(48)) * 3 + 4


def _prep(tokens: int, rows: int, decode_only: bool = False):
    return types.SimpleNamespace(positions=np.zeros(tokens), logits_indices=np.zeros(rows),
                                 decode_only=decode_only, num_drafts=None,
                                 sample_rows=np.zeros(rows), seq_lens=np.zeros(rows))


def test_steps_the_graphs_cannot_hold_run_eagerly(model_dir):
    w = _worker(model_dir)
    g = graphs.attach(w)
    fwd = StepForward(w.runner.model, w.runner.kv_caches, w.device, 8, g.decode, g.mixed)
    assert fwd.mode(_prep(8, 8, decode_only=True)) == "full"
    assert fwd.mode(_prep(48, 3)) == "piecewise" and fwd.mode(_prep(1, 1)) == "piecewise"
    assert fwd.mode(_prep(49, 3)) == "eager"     # more tokens than the largest bucket
    assert fwd.mode(_prep(40, 9)) == "eager"     # more sampled rows than the LM-head graphs hold
    fwd.graphs = None                            # --cudagraph-mode piecewise: decodes too
    assert fwd.mode(_prep(8, 8, decode_only=True)) == "piecewise"


def _step(step_id, new=(), running=(), finished=()):
    """new: (seq id, prompt, blocks); running: (seq id, new blocks) decoding one token."""
    step = wpb.StepRequest(step_id=step_id, finished_seq_ids=list(finished))
    for sid, prompt, blocks in new:
        step.new_seqs.add(seq_id=sid, prompt_token_ids=prompt, block_ids=blocks,
                          num_scheduled_tokens=len(prompt),
                          sampling=wpb.Sampling(top_p=1, repetition_penalty=1, logprobs=3))
    for sid, blocks in running:
        step.running_seq_ids.append(sid)
        step.running_num_scheduled.append(1)
        step.running_new_block_counts.append(len(blocks))
        step.running_new_block_ids.extend(blocks)
    return step


def _written_slots(caches) -> set[int]:
    k = caches[0][0]   # layer 0's keys [blocks, block_size, heads, dim]
    return set(torch.nonzero(k.flatten(2).abs().sum(-1).flatten()).flatten().tolist())


def compare_steps(eager, graphed, steps) -> list[tuple[str, str]]:
    """Runs each step on both workers: the same tokens, logprobs and top ids; returns the
    (kind, graph) of every launch, eager's then the other's, step by step."""
    seen = []
    for step in steps:
        results = []
        for w in (eager, graphed):
            launched = w.runner.launch(step)
            results.append(w.runner.finish(launched))
            seen.append((launched.kind, launched.graph))
        a, b = results
        assert list(a.token_ids) == list(b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert list(a.top_token_ids) == list(b.top_token_ids)
    return seen


def verify_beside_chunk(workers) -> tuple[list, list[tuple[str, str]]]:
    """A prompt whose last token is decoded next, then a verify of 3 ngram drafts beside a new
    10-token prompt, on each worker in turn: (results, (kind, graph) of every launch)."""
    first = _step(1, new=[(1, [5, 6, 7, 8, 5, 6, 7], [0, 1, 2])])
    first.new_seqs[0].num_scheduled_tokens = 6      # its last prompt token is decoded next
    second = _step(2, new=[(2, list(range(20, 30)), [3, 4, 5])], running=[(1, [])])
    second.running_num_spec.append(3)               # drafts 8, 5, 6: the lookup matches 5 6 7
    results, modes = [], []
    for w in workers:
        for step in (first, second):
            launched = w.runner.launch(step)
            results.append(w.runner.finish(launched))
            modes.append((launched.kind, launched.graph))
    return results, modes


SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_padded_tokens_write_no_kv_and_logits_match_eager(model_dir):
    eager = _worker(model_dir, num_kv_blocks=16, enforce_eager=True)
    piecewise = _worker(model_dir, num_kv_blocks=16)
    g = graphs.attach(piecewise)
    steps = [_step(1, new=[(1, [5, 6, 7, 8, 9], [0, 1]), (2, [3, 4, 5, 6, 7, 8], [2, 3])]),
             _step(2, new=[(3, [11, 12, 13, 14, 15, 16, 17], [4, 5])], running=[(1, []), (2, [])])]
    seen = compare_steps(eager, piecewise, steps)
    # 11 tokens ran in the 16-token bucket, then 2 decodes and 7 prompt tokens in it again
    assert seen == [("prefill", "eager"), ("prefill", "piecewise"), ("mixed", "eager"), ("mixed", "piecewise")]
    assert g.mixed.num_replays == 2 and g.mixed.bucket(11) == g.mixed.bucket(9) == 16
    real = {0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19, 20, 21, 22, 5, 14}
    assert _written_slots(piecewise.runner.kv_caches) == _written_slots(eager.runner.kv_caches) == real
    for ca, cb in zip(eager.runner.kv_caches, piecewise.runner.kv_caches):
        torch.testing.assert_close(ca, cb, atol=1e-5, rtol=1e-5)


def test_the_lm_head_runs_over_the_sampled_rows_only(model_dir, monkeypatch):
    w = _worker(model_dir)
    g = graphs.attach(w, "piecewise")
    rows, real = [], w.runner.model.logits
    monkeypatch.setattr(w.runner.model, "logits", lambda h, out=None: rows.append(len(h)) or real(h, out))
    # a 30-token prompt (no sample: more follows) beside a 5-token one (samples): one row
    step = wpb.StepRequest(step_id=1)
    step.new_seqs.add(seq_id=1, prompt_token_ids=list(range(3, 40)), block_ids=list(range(10)),
                      num_scheduled_tokens=30, sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    step.new_seqs.add(seq_id=2, prompt_token_ids=[5, 6, 7, 8, 9], block_ids=[10, 11],
                      num_scheduled_tokens=5, sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    result = w.runner.finish(w.runner.launch(step))
    assert list(result.seq_ids) == [2] and g.mixed.num_replays == 1
    assert rows == ([] if CUDA else [1])   # a captured LM head replays without calling it


def test_a_verify_beside_a_prefill_chunk_replays_piecewise_as_eager_runs_it(model_dir):
    workers = [_worker(model_dir, enforce_eager=True, speculative_config=SPEC),
               _worker(model_dir, speculative_config=SPEC)]
    graphs.attach(workers[1])
    results, modes = verify_beside_chunk(workers)
    assert modes == [("prefill", "eager"), ("verify", "eager"), ("prefill", "piecewise"), ("verify", "piecewise")]
    eager, piecewise = results[1], results[3]
    assert list(eager.seq_ids) == [2, 1] and list(eager.num_draft_tokens) == [0, 3]   # new ones first
    for field in ("seq_ids", "token_ids", "num_tokens", "num_draft_tokens"):
        assert list(getattr(eager, field)) == list(getattr(piecewise, field)), field


def _requests():
    lengths = [3, 19, 40, 7, 33, 12]
    return [dict(prompt_token_ids=pb.TokenIds(ids=[(7 * i + 3 * j) % 300 + 2 for j in range(n)]),
                 max_tokens=6 + i, ignore_eos=True, sampling=GREEDY, logprobs=2)
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("mode,quantization", [("full_and_piecewise", None), ("piecewise", None),
                                               ("full_and_piecewise", "int8"), ("full", None),
                                               ("full", "int8")])
def test_greedy_outputs_with_mixed_graphs_equal_eager(model_dir, mode, quantization):
    """Chunked prompts beside running decodes (max 48 tokens a step): prefill, mixed and decode
    steps, replayed piecewise or by full step graphs (and decodes by the decode graphs, but in
    piecewise mode), give eager's tokens and logprobs; quantized layers too."""
    cfg = EngineConfig(max_running=8, max_batched_tokens=48)
    eager = _worker(model_dir, enforce_eager=True, quantization=quantization)
    reference, _ = asyncio.run(run(model_dir, eager, _requests(), cfg))
    w = _worker(model_dir, cudagraph_mode=mode, quantization=quantization)
    g = graphs.attach(w, mode)
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(model_dir, w, _requests(), cfg))
    for a, b in zip(reference, out):
        for (ta, xa, ra, la), (tb, xb, rb, lb) in zip(a, b):
            assert (ta, ra) == (tb, rb)
            np.testing.assert_allclose([v for _, v in la], [v for _, v in lb], atol=1e-4)
    kinds, label = set(seen), "full" if mode == "full" else "piecewise"
    assert ("mixed", label) in kinds and ("prefill", label) in kinds
    assert ("decode", "piecewise" if mode == "piecewise" else "full") in kinds
    assert not any(graph == "eager" for _, graph in kinds) and g.mixed.num_replays > 0


# the step graphs' modes on a GPU: (--cudagraph-mode, the graph label of a mixed step)
GPU_MODES = [("full_and_piecewise", "piecewise"), ("full", "full")]


@pytest.mark.skipif(not CUDA, reason="HEADRACE_TEST_DEVICE=cuda: real CUDA graphs")
@pytest.mark.parametrize("mode,label", GPU_MODES)
@pytest.mark.parametrize("variant", ["llama-gqa4-hd64-untied", "qwen3-qknorm-gqa4-hd128"])
def test_gpu_graphs_equal_eager_and_transformers(variant, mode, label, checkpoint_factory):
    import transformers

    path = str(checkpoint_factory(variant))
    cfg = EngineConfig(max_running=8, max_batched_tokens=48)
    eager, _ = asyncio.run(run(path, _worker(path, enforce_eager=True), _requests(), cfg))
    w = _worker(path, cudagraph_mode=mode)
    assert w.graphs.mixed is not None and w.graphs.capture_seconds > 0
    assert 0 < w.graphs.estimated_bytes and 0 < w.graphs.measured_bytes
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(path, w, _requests(), cfg))
    assert ("mixed", label) in set(seen) and ("decode", "full") in set(seen)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for req, a, b in zip(_requests(), eager, out):
        prompt = list(req["prompt_token_ids"].ids)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=req["max_tokens"], do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert a[0][0] == b[0][0] == ref


@pytest.mark.skipif(not (CUDA and os.environ.get("HEADRACE_TEST_QWEN3_DIR")),
                    reason="HEADRACE_TEST_DEVICE=cuda and HEADRACE_TEST_QWEN3_DIR (a Qwen3-0.6B-shaped "
                           "checkpoint, bench.random_checkpoint)")
@pytest.mark.parametrize("mode,label", GPU_MODES)
def test_gpu_qwen3_0_6b_graphs_equal_eager(mode, label):
    path = os.environ["HEADRACE_TEST_QWEN3_DIR"]
    cfg = EngineConfig(max_running=64, max_batched_tokens=512)
    reqs = [dict(prompt_token_ids=pb.TokenIds(ids=[(31 * i + 7 * j) % 10000 for j in range(40 + 37 * i)]),
                 max_tokens=24, ignore_eos=True, sampling=GREEDY) for i in range(24)]
    opts = dict(num_kv_blocks=2048, block_size=16, max_num_seqs=64, max_batched_tokens=512)
    eager, _ = asyncio.run(run(path, _worker(path, enforce_eager=True, **opts), reqs, cfg))
    w = _worker(path, cudagraph_mode=mode, **opts)
    seen = graphs.record_modes(w.runner)
    out, _ = asyncio.run(run(path, w, reqs, cfg))
    assert ("mixed", label) in set(seen)
    assert [a[0][0] for a in eager] == [b[0][0] for b in out]
