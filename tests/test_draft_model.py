"""Speculative decoding with a draft model (``method: draft_model``): greedy output identical
to speculation off across prefix hits, preemption, chunked prefill, n > 1 (copy on write),
stops and max_tokens; the draft's KV kept in step with the target's (a draft equal to the
target accepts every greedy draft); a random draft changes nothing but the acceptance; the
worker refuses what it cannot serve with one clear line."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from headrace.controlplane.engine.loop import EngineConfig
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import inference_pb2 as pb
from tests.checkpoints import make_checkpoint
from tests.spec_harness import run, worker
from tests.test_speculative import _assert_same, _completions, _requests

MODEL = str(default_model_dir())
GREEDY = pb.SamplingParams(temperature=0.0)


def _draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A random one-layer Llama over the target's vocabulary (2048 ids): a poor proposer."""
    return str(make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", heads=2, kv_heads=1,
                               head_dim=32, layers=1, vocab=2048, seed=5))


def _run_both(draft: str, blocks: int = 44, budget: int = 48):
    cfg = EngineConfig(max_running=16, max_batched_tokens=budget)
    reqs = _requests()
    off, _ = asyncio.run(run(MODEL, worker(MODEL, None, num_kv_blocks=blocks, max_batched_tokens=budget),
                             reqs, cfg))
    w = worker(MODEL, _draft(draft), num_kv_blocks=blocks, max_batched_tokens=budget)
    on, engine = asyncio.run(run(MODEL, w, reqs, cfg))
    return off, on, engine, w


def test_a_draft_equal_to_the_target_accepts_every_greedy_draft_and_changes_nothing():
    """The draft's KV must hold exactly what the target's does (prefill chunks, prefix hits,
    preemption's recompute, n > 1's copied blocks) for its greedy proposals to match."""
    off, on, engine, w = _run_both(MODEL)
    _assert_same(_completions(off), _completions(on))
    spec, sched = engine.scheduler.speculation, engine.scheduler
    assert sched.num_preemptions > 0 and sched.blocks.prefix_hits > 0
    assert spec.num_draft_tokens > 40, spec.num_draft_tokens
    # every request but the sampled one (temperature 0.9) is greedy; stops and max_tokens
    # cut some accepted drafts, sampled rows reject some: the rest must all be accepted
    assert spec.num_accepted_tokens / spec.num_draft_tokens > 0.8, (spec.num_accepted_tokens, spec.num_draft_tokens)
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1] > 0
    assert sched.blocks.num_free == sched.blocks.num_blocks and not any(sched.blocks.ref)
    assert w.runner.draft.num_forwards > 0


def test_greedy_only_requests_accept_all_drafts_with_a_draft_equal_to_the_target():
    doc = "It is a truth universally acknowledged, that a single man "
    reqs = [dict(prompt=doc + str(i), max_tokens=21, ignore_eos=True, sampling=GREEDY) for i in range(3)]
    off, _ = asyncio.run(run(MODEL, worker(MODEL, None), reqs))
    on, engine = asyncio.run(run(MODEL, worker(MODEL, _draft(MODEL)), reqs))
    assert [r[0][0] for r in off] == [r[0][0] for r in on]
    spec = engine.scheduler.speculation
    # 20 tokens after the first: k = 4 drafts accepted per verify, + 1 bonus each time
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens


def test_a_random_draft_changes_only_the_acceptance(random_draft):
    off, on, engine, _ = _run_both(random_draft)
    _assert_same(_completions(off), _completions(on))
    spec = engine.scheduler.speculation
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens / spec.num_draft_tokens < 0.5


def test_the_draft_shares_the_targets_block_ids_and_memory_is_counted(random_draft):
    w = worker(MODEL, _draft(random_draft), num_kv_blocks=32)
    plain = worker(MODEL, None, num_kv_blocks=32)
    draft = w.runner.draft
    assert len(draft.kv_caches) == 1 and draft.kv_caches[0].shape[1] == w.runner.num_blocks == 32
    assert w.block_bytes == plain.block_bytes + draft.bytes_per_block(4, w.kv_dtype)
    info = w.describe()
    assert info.speculative.method == "draft_model" and info.speculative.model == random_draft


def _start(spec: dict, **options):
    opts = dict(model=MODEL, device="cpu", dtype="float32", num_kv_blocks=32, block_size=4,
                speculative_config=json.dumps(spec))
    opts.update(options)
    return Worker(WorkerOptions(**opts))


def test_the_worker_refuses_what_it_cannot_serve(tmp_path, random_draft):
    with pytest.raises(ValueError, match="no such directory"):
        _start(_draft(str(tmp_path / "nowhere")))
    big = make_checkpoint(tmp_path / "big", "llama", layers=1, vocab=4096)
    with pytest.raises(ValueError, match="vocabulary .4096. is larger than the target's .2048."):
        _start(_draft(str(big)))
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        _start(_draft(random_draft), kv_offloading_size=0.01)


def test_propose_drafts_greedily_from_the_last_token():
    """A draft equal to the target proposes what the target's own greedy decodes produce."""
    w = worker(MODEL, _draft(MODEL), num_kv_blocks=32)
    reqs = [dict(prompt="The ", max_tokens=12, ignore_eos=True, sampling=GREEDY)]
    off, _ = asyncio.run(run(MODEL, worker(MODEL, None), reqs))
    on, engine = asyncio.run(run(MODEL, w, reqs))
    tokens = off[0][0][0]
    assert on[0][0][0] == tokens and len(tokens) == 12
    assert np.all(np.asarray(tokens) < 2048)


def test_tensor_parallel_drafts_are_refused_with_one_line():
    from headrace.common import speculative
    from headrace.dataplane import draft_model
    from headrace.dataplane.config import load_model_config

    config = speculative.parse(json.dumps(_draft(MODEL)))
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        draft_model.check_options(config, load_model_config(MODEL), 2, 0.0)
    assert draft_model.check_options(config, load_model_config(MODEL), 1, 0.0) == MODEL


def test_no_blocks_leak_after_random_cancels_with_a_draft(random_draft):
    import random

    rng = random.Random(7)
    passage = "It is a truth universally acknowledged, that a single man "
    reqs = [dict(prompt=passage + str(i), max_tokens=20, ignore_eos=True, sampling=GREEDY,
                 n=1 + (i % 2)) for i in range(6)]
    aborts = {i: rng.randint(1, 12) for i in rng.sample(range(6), 4)}
    for draft in (MODEL, random_draft):
        _, engine = asyncio.run(run(MODEL, worker(MODEL, _draft(draft), num_kv_blocks=40), reqs,
                                    abort_after=aborts))
        blocks = engine.scheduler.blocks
        assert engine.scheduler.speculation.num_drafts > 0
        assert blocks.num_free == blocks.num_blocks and not any(blocks.ref)


def test_a_draft_with_a_smaller_vocabulary_reads_every_target_id(tmp_path):
    """Ids past the draft's vocabulary (the target's padding) are clamped, not an index error."""
    small = str(make_checkpoint(tmp_path / "small", "llama", heads=2, kv_heads=1, head_dim=32,
                                layers=1, vocab=1024, seed=3))
    w = worker(MODEL, _draft(small), num_kv_blocks=32)
    assert w.runner.draft.max_id == 1023
    reqs = [dict(prompt_token_ids=pb.TokenIds(ids=[0, 1500, 2000, 1999, 7]), max_tokens=10,
                 ignore_eos=True, sampling=GREEDY)]
    off, _ = asyncio.run(run(MODEL, worker(MODEL, None), reqs))
    on, engine = asyncio.run(run(MODEL, w, reqs))
    assert on[0][0][0] == off[0][0][0] and engine.scheduler.speculation.num_draft_tokens > 0
