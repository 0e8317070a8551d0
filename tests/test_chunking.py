"""Latency-aware chunking (``headrace.controlplane.scheduling.chunking`` and the scheduler's prefill
phase): the fair split (hypothesis), short prompts passing long ones, and the scheduler's invariants
under random workloads (hypothesis): the token budget, the budget of a step with decodes and the
per-prefill cap hold; nobody starves; a short prompt that arrives while long ones are chunked is
computed whole in the next step. End to end (real planes, CPU): greedy outputs with tight chunking
equal those of an engine that never chunks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.scheduling.chunking import Chunking, water_fill
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.scheduling.scheduler import Scheduler
from tests.test_scheduler import Clock, drain, make_request, run_step


@settings(max_examples=300, deadline=None)
@given(wants=st.lists(st.integers(0, 300), max_size=8), budget=st.integers(0, 1000))
def test_water_fill_is_max_min_fair_and_spends_what_it_can(wants, budget):
    shares = water_fill(wants, budget)
    assert len(shares) == len(wants)
    assert sum(shares) == min(budget, sum(wants))
    assert all(0 <= s <= w for s, w in zip(shares, wants))
    for s, w in zip(shares, wants):   # one left wanting has (within rounding) the most of anyone
        if s < w:
            assert s >= max(shares) - 1


def test_water_fill_gives_short_ones_all_they_need():
    assert water_fill([1000, 30, 1000, 50], 1024) == [472, 30, 472, 50]
    assert water_fill([5, 5], 3) == [2, 1]


@settings(max_examples=200, deadline=None)
@given(needs=st.lists(st.integers(1, 2000), max_size=12), long=st.integers(1, 4))
def test_order_keeps_at_most_the_allowed_long_ones_ahead_of_short_ones(needs, long):
    c = Chunking(max_prefill_tokens_with_decodes=1024, max_num_partial_prefills=4,
                 max_long_partial_prefills=long)
    items = list(enumerate(needs))
    order = c.order(items, lambda x: x[1])
    assert sorted(order) == items
    is_long = [n > c.long_threshold for _, n in order]
    last_short = max((i for i, x in enumerate(is_long) if not x), default=0)
    assert sum(is_long[:last_short]) <= long
    for kind in (True, False):   # each kind keeps its service order
        idx = [i for i, n in order if (n > c.long_threshold) == kind]
        assert idx == sorted(idx)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_prefill_tokens_with_decodes=0), "max_prefill_tokens_with_decodes"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
    (dict(max_long_partial_prefills=3, max_num_partial_prefills=2), "<= max_num_partial_prefills"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
])
def test_bad_options_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Chunking(**kwargs)


def test_long_threshold_defaults_to_an_even_share_of_a_decode_step():
    assert Chunking().long_threshold == 2048 // 4
    assert Chunking(long_prefill_token_threshold=100).long_threshold == 100
    assert Chunking(max_prefill_tokens_with_decodes=512).prefill_budget(4000, True) == 512
    assert Chunking(max_prefill_tokens_with_decodes=512).prefill_budget(4000, False) == 4000


def _sched(chunking, budget, blocks=4000, cap=64, clock=None):
    return Scheduler(BlockManager(blocks, 4, False), cap, budget, Policy(), watermark=0.0,
                     clock=clock or Clock(), chunking=chunking)


def _split(step) -> tuple[int, bool, list[int]]:
    """Before ``after_step``: (prompt tokens of the step, whether it carries decodes, each
    prefill's chunk). A decode: a running sequence computing its one token left."""
    chunks = [r.num_tokens for r in step.new]
    decodes = False
    for seq, n in zip(step.running.seqs, step.running.num_tokens):
        if seq.num_total - seq.num_computed == 1:
            decodes = True
        else:
            chunks.append(n)
    return sum(chunks), decodes, chunks


def _play(sched, step) -> None:
    """The worker's part of ``tests.test_scheduler.run_step``, after the scheduling."""
    sched.after_step(step)
    for seq, _ in step.scheduled():
        if seq.num_inflight:
            seq.num_inflight -= 1
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq, 1)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(8, 96), itl=st.integers(1, 64),
       partial=st.integers(1, 4), long=st.integers(1, 4), cap=st.sampled_from([0, 0, 5, 17]),
       blocks=st.sampled_from([12, 40, 4000]))
def test_random_workloads_keep_the_budgets_and_nobody_starves(seed, budget, itl, partial, long, cap, blocks):
    long = min(long, partial)
    chunking = Chunking(itl, partial, long, cap)
    rng = random.Random(seed)
    clock = Clock()
    sched = _sched(chunking, budget, blocks=blocks, cap=rng.randint(1, 12), clock=clock)
    capacity = blocks * 4
    reqs = []
    for t in range(60):
        clock.now = float(t)
        if rng.random() < 0.4:
            prompt = rng.choice([rng.randint(1, 6), rng.randint(20, 200)])
            prompt = [rng.randrange(1000) for _ in range(min(prompt, capacity - 2))]
            req = make_request(prompt, max_tokens=rng.randint(1, min(12, capacity - len(prompt))))
            sched.add(req.sequences)
            reqs.append(req)
        step = sched.schedule()
        tokens, decodes, chunks = _split(step)
        _play(sched, step)
        assert step.num_tokens <= budget
        if decodes:
            assert tokens <= itl, "a step with decodes carried more prompt tokens than its budget"
        if cap:
            assert all(n <= cap for n in chunks)
    drain(sched, limit=5000)   # every request finishes: no prefill is starved
    assert all(s.finished for r in reqs for s in r.sequences)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), partial=st.integers(2, 4), longs=st.integers(0, 6),
       decodes=st.integers(0, 20), short=st.integers(1, 128))
def test_a_short_prompt_is_computed_whole_in_the_next_step_beside_long_ones(seed, partial, longs,
                                                                          decodes, short):
    """Long prompts being chunked and decodes running: a short prompt (at most an even share
    of the budget with decodes) that arrives is computed whole in the very next step."""
    rng = random.Random(seed)
    itl = 512
    chunking = Chunking(itl, partial, 1)
    short = min(short, chunking.long_threshold)
    sched = _sched(chunking, budget=itl + decodes + 64, blocks=20_000)
    for _ in range(decodes):   # running decodes: prompt computed, a token in flight
        sched.add(make_request([rng.randrange(1000) for _ in range(rng.randint(1, 4))], max_tokens=50).sequences)
    for _ in range(longs):
        sched.add(make_request([rng.randrange(1000) for _ in range(rng.randint(4000, 6000))], max_tokens=5).sequences)
    for _ in range(3):
        run_step(sched)
    new = make_request([rng.randrange(1000) for _ in range(short)], max_tokens=3)
    sched.add(new.sequences)
    step = run_step(sched)
    got = {r.seq.request_id: r.num_tokens for r in step.new}
    assert got.get(new.request_id) == short
    running_longs = [n for s, n in zip(step.running.seqs, step.running.num_tokens) if n > 1]
    if longs:   # and the first long one still gets its chunk (not starved by the short one)
        assert running_longs and running_longs[0] >= itl // partial


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", heads=4, kv_heads=2, head_dim=32)


def test_greedy_outputs_with_tight_chunking_equal_an_engine_that_never_chunks(model_dir):
    from tests.test_scheduling_e2e import GREEDY, _run_all   # noqa: F401 (GREEDY: same requests)
    from tests.harness import Planes

    rng = random.Random(7)
    jobs = [([rng.randrange(2, 384) for _ in range(rng.choice([3, 9, 60, 140]))], rng.randrange(4, 24))
            for _ in range(14)]
    outputs = []
    for config in (EngineConfig(max_batched_tokens=4096, chunking=Chunking(4096, 16, 16)),
                   EngineConfig(max_batched_tokens=48, chunking=Chunking(12, 3, 1, 20))):
        planes = Planes(model_dir, num_kv_blocks=256, config=config)
        try:
            outputs.append(_run_all(planes, jobs))
        finally:
            planes.close()
    assert outputs[0] == outputs[1]
    assert all(len(out) == n for out, (_, n) in zip(outputs[0], jobs))
