"""Multi-LoRA serving on a GPU (skipped without one; ``HEADRACE_TEST_DEVICE=cuda`` or any visible
GPU): bfloat16 steps replayed from the CUDA graphs (decode graphs, piecewise prefill pieces, each
in its LoRA variant) give the eager steps' tokens; and a slot load that follows a step still
reading the slot (its copy runs on a copy stream) waits for that step: the step in flight gets
the slot's old adapter, the next one the new adapter."""

from __future__ import annotations

import os

import pytest
import torch

from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.worker.v1 import worker_pb2 as wpb
from tests.checkpoints import make_checkpoint
from tests.lora_harness import greedy_on_worker, make_adapter

pytestmark = pytest.mark.skipif(
    not (os.environ.get("HEADRACE_TEST_DEVICE", "").startswith("cuda") and torch.cuda.is_available()),
    reason="needs a CUDA GPU (HEADRACE_TEST_DEVICE=cuda)")
PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 8, 250, 31], [60, 61, 62, 63, 64, 65, 66, 67, 68]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gpu")
    base = make_checkpoint(root / "base", "qwen3", heads=8, kv_heads=2, head_dim=64)
    return base, [make_adapter(base, root / f"a{i}", seed=i, r=8) for i in range(2)]


def _worker(base, **options) -> Worker:
    opts = dict(model=str(base), device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16,
                max_num_seqs=8, max_batched_tokens=128, enable_lora=True, max_loras=2,
                max_lora_rank=8, max_cpu_loras=2)
    return Worker(WorkerOptions(**(opts | options)))


def _cache(worker, adapters):
    for i, path in enumerate(adapters):
        worker.load_adapter(wpb.LoadAdapterRequest(adapter_id=100 + i, path=str(path)))


def test_graphs_replay_the_eager_tokens_in_bfloat16(model):
    base, adapters = model
    seqs = [(PROMPTS[0], 1), (PROMPTS[1], 0), (PROMPTS[2], 2)]
    out = []
    for options in ({}, {"enforce_eager": True}):
        worker = _worker(base, **options)
        _cache(worker, adapters)
        out.append(greedy_on_worker(worker, seqs, 8, [(1, 100), (2, 101)]))
    assert out[0] == out[1]
    assert out[0][0] != out[0][1] != out[0][2]


def test_a_load_waits_for_the_step_still_reading_the_slot(model):
    """Step 2 decodes a sequence of slot 1 (adapter 100); step 3, sent before step 2 is finished,
    forgets it and loads adapter 101 into slot 1 for a new sequence. Step 2's token is adapter
    100's (as when nothing follows), step 3's prefill is adapter 101's."""
    base, adapters = model
    worker = _worker(base)
    _cache(worker, adapters)
    runner = worker.runner

    def new_seq(step, seq_id, prompt, blocks):
        step.new_seqs.add(seq_id=seq_id, prompt_token_ids=prompt, block_ids=blocks,
                          num_scheduled_tokens=len(prompt), lora_slot=1,
                          sampling=wpb.Sampling(top_p=1, repetition_penalty=1))

    def first_two(load_after: bool):
        runner.reset()
        step = wpb.StepRequest(step_id=1, flush=True)
        step.lora_loads.add(slot=1, adapter_id=100)
        new_seq(step, 1, PROMPTS[0], [0, 1])
        first = runner.finish(runner.launch(step)).token_ids[0]
        decode = wpb.StepRequest(step_id=2, running_seq_ids=[1], running_num_scheduled=[1],
                                 running_new_block_counts=[0])
        launched = runner.launch(decode)   # on the device, not finished
        nxt = None
        if load_after:
            step3 = wpb.StepRequest(step_id=3, flush=True, finished_seq_ids=[1])
            step3.lora_loads.add(slot=1, adapter_id=101)
            new_seq(step3, 2, PROMPTS[1], [4, 5])
            nxt = runner.launch(step3)
        second = runner.finish(launched).token_ids[0]
        third = runner.finish(nxt).token_ids[0] if nxt is not None else None
        return first, second, third

    alone = first_two(load_after=False)
    followed = first_two(load_after=True)
    assert followed[:2] == alone[:2]
    runner.reset()
    ref = greedy_on_worker(worker, [(PROMPTS[1], 1)], 1, [(1, 101)], first_step=50)[0][0]
    assert followed[2] == ref
