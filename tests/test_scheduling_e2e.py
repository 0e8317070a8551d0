"""End to end on CPU: greedy outputs with prefix caching, chunked prefill and preemption
(forced by a tiny KV pool) equal the outputs of a roomy engine without them; parallel
samples; cached-token usage."""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest

from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.scheduling.policy import Policy
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from headrace.v1 import inference_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", heads=4, kv_heads=2, head_dim=32)


def _workload(seed=3, n=24):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 384) for _ in range(40)]
    jobs = []
    for i in range(n):
        prefix = shared[:rng.randrange(0, 40)] if i % 2 else []
        prompt = prefix + [rng.randrange(2, 384) for _ in range(rng.randrange(1, 30))]
        jobs.append((prompt, rng.randrange(1, 40)))
    return jobs


def _run_all(planes, jobs):
    def run(job):
        prompt, n = job
        return completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n,
                                          ignore_eos=True, sampling=GREEDY))[0]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


@pytest.mark.parametrize("policy", ["fifo", "priority", "sjf"])
def test_outputs_equal_with_prefix_cache_chunking_and_preemption(model_dir, policy):
    jobs = _workload()
    roomy = Planes(model_dir, num_kv_blocks=512,
                   config=EngineConfig(max_batched_tokens=4096, enable_prefix_cache=False))
    try:
        expected = _run_all(roomy, jobs)
        assert roomy.engine.scheduler.num_preemptions == 0
    finally:
        roomy.close()
    # 8 blocks of 16 tokens: far less than 24 concurrent requests need; 24-token chunks.
    tight = Planes(model_dir, num_kv_blocks=8,
                   config=EngineConfig(max_batched_tokens=24, policy=Policy(policy)))
    try:
        got = _run_all(tight, jobs)
        sched = tight.engine.scheduler
        assert sched.num_preemptions > 0, "the tiny pool must force preemption"
        assert sched.blocks.prefix_hits > 0, "shared prefixes must hit the cache"
        assert tight.wait_for_free_blocks(8) == 8
    finally:
        tight.close()
    assert got == expected


def test_cached_prompt_tokens_are_reported(model_dir):
    planes = Planes(model_dir, num_kv_blocks=64)
    try:
        prompt = list(range(2, 60))
        first = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=3, sampling=GREEDY,
                                ignore_eos=True)
        second = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=3, sampling=GREEDY,
                                 ignore_eos=True)
        assert first[-1].usage.cached_prompt_tokens == 0
        assert second[-1].usage.cached_prompt_tokens == 48       # 3 full blocks of 16
        assert completion(first)[0] == completion(second)[0]
    finally:
        planes.close()


def test_parallel_samples_share_the_prompt(model_dir):
    planes = Planes(model_dir, num_kv_blocks=64, config=EngineConfig(enable_prefix_cache=False))
    try:
        prompt = list(range(2, 40))
        responses = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=6, n=4,
                                    ignore_eos=True,
                                    sampling=pb.SamplingParams(temperature=1.0, seed=5))
        by_index = {}
        for r in responses:
            by_index.setdefault(r.index, []).append(r)
        assert sorted(by_index) == [0, 1, 2, 3]
        outs = [completion(rs)[0] for _, rs in sorted(by_index.items())]
        assert all(len(o) == 6 for o in outs) and len(set(map(tuple, outs))) > 1
        for rs in by_index.values():
            assert rs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # greedy samples of one prompt are identical to a single greedy run
        greedy = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=6, n=3,
                                 ignore_eos=True, sampling=GREEDY)
        single = completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=6,
                                            ignore_eos=True, sampling=GREEDY))[0]
        per = {}
        for r in greedy:
            per.setdefault(r.index, []).extend(r.token_ids)
        assert all(v == single for v in per.values())
        assert planes.wait_for_free_blocks(64) == 64
    finally:
        planes.close()


def test_overlap_on_and_off_give_the_same_outputs(model_dir):
    """Three steps in flight (the default), two and one: same greedy tokens, text and finish
    reasons, with stop tokens, stop strings and max_tokens all exact (nothing extra streams)."""
    rng = random.Random(11)
    jobs = [([rng.randrange(2, 384) for _ in range(rng.randrange(2, 30))], rng.randrange(1, 24))
            for _ in range(16)]

    def run_all(planes):
        probe = {}
        def run(i):
            prompt, n = jobs[i]
            base = dict(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n, sampling=GREEDY)
            if i % 3 == 1:    # stop at the third distinct token of a plain run, if any
                base["stop_token_ids"] = [probe[i][2]] if len(probe[i]) > 2 else []
            if i % 3 == 2:
                base["stop"] = ["e", "a"]
            return completion(planes.generate(ignore_eos=i % 3 != 1, **base))

        plain = {i: completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=jobs[i][0]),
                                               max_tokens=jobs[i][1], ignore_eos=True,
                                               sampling=GREEDY))[0] for i in range(len(jobs))}
        probe.update(plain)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(run, range(len(jobs))))

    outputs = {}
    for depth in (1, 2, 3):
        planes = Planes(model_dir, num_kv_blocks=64, config=EngineConfig(pipeline_depth=depth))
        try:
            outputs[depth] = run_all(planes)
            assert planes.wait_for_free_blocks(64) == 64
        finally:
            planes.close()
    assert outputs[1] == outputs[2] == outputs[3]
    reasons = {r for _, _, r in outputs[3]}
    assert pb.FINISH_REASON_STOP in reasons and pb.FINISH_REASON_LENGTH in reasons


def test_three_steps_in_flight_waste_at_most_one_slot_per_early_stop(model_dir):
    """With three steps in flight a request that stops early must not cost two wasted slots:
    on a stop token the worker leaves it out of the step it already holds; with stop strings
    the control plane keeps two steps in flight. Counted as tokens the worker sampled minus
    tokens the request got, one request at a time."""
    planes = Planes(model_dir, num_kv_blocks=64, config=EngineConfig(pipeline_depth=3))
    counter = planes.worker_server.worker_service.metrics.sampled

    def sampled() -> float:
        """The worker's sampled-token count once it stops moving: steps still in flight when
        a request's stream ended are counted after it (they are its wasted slots)."""
        value, deadline = counter._value.get(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.2)
            value, last = counter._value.get(), value
            if value == last:
                break
        return value
    try:
        prompt = pb.TokenIds(ids=[7, 99, 3, 250, 41])
        plain, text, _ = completion(planes.generate(prompt_token_ids=prompt, max_tokens=24,
                                                    ignore_eos=True, sampling=GREEDY))
        stop_at = next(i for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
        char = next(c for i, c in enumerate(text) if i >= 3 and c not in text[:i] and c.isalnum())
        cases = [dict(stop_token_ids=[plain[stop_at]], ignore_eos=True),
                 dict(stop=[char], ignore_eos=True)]
        for extra in cases:
            before = sampled()
            ids, _, reason = completion(planes.generate(prompt_token_ids=prompt, max_tokens=24,
                                                        sampling=GREEDY, **extra))
            assert reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_STOP_STRING)
            assert len(ids) < len(plain) and ids == plain[:len(ids)]
            assert sampled() - before - len(ids) <= 1, extra
    finally:
        planes.close()
