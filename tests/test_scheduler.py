"""FIFO scheduler: admission, token budget, preemption by recompute, and invariants under
random workloads (hypothesis)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.block_manager import BlockManager
from controlplane.output import OutputText
from controlplane.request import Request, Status
from controlplane.scheduler import Scheduler
from headrace.dataplane.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


class _NoText:
    def step(self, token_id):
        return ""

    def flush(self):
        return ""


def make_request(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(request_id=str(seq_id), seq_id=seq_id, prompt_token_ids=[3] * prompt_len,
                   sampling=wpb.Sampling(), max_tokens=max_tokens, min_tokens=0,
                   stop_token_ids=frozenset(), output=OutputText(_NoText(), []))


def run_step(sched: Scheduler, finished: list[Request] | None = None):
    """Schedules one step and plays the worker: every request that reached its end samples."""
    step = sched.schedule()
    sched.after_step(step)
    for req, _ in step.scheduled():
        if req.status is Status.RUNNING and req.num_computed == req.num_tokens:
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, pb.FINISH_REASON_LENGTH)
                if finished is not None:
                    finished.append(req)
    return step


def test_fifo_admission_respects_budget_and_cap():
    sched = Scheduler(BlockManager(100, 4), max_running=2, max_batched_tokens=20)
    reqs = [make_request(i, 8) for i in range(4)]
    for r in reqs:
        sched.add(r)
    step = sched.schedule()
    assert [r.seq_id for r, _ in step.new] == [0, 1]  # cap of 2 running
    assert sum(n for _, n in step.scheduled()) == 16


def test_budget_stops_admission_in_order():
    sched = Scheduler(BlockManager(100, 4), max_running=8, max_batched_tokens=10)
    big, small = make_request(1, 10), make_request(2, 1)
    sched.add(big)
    sched.add(small)
    assert [r.seq_id for r, _ in sched.schedule().new] == [1]  # small waits its turn (FIFO)


def test_preemption_when_blocks_run_out_then_everything_finishes():
    sched = Scheduler(BlockManager(6, 4), max_running=8, max_batched_tokens=64)
    reqs = [make_request(i, 7, max_tokens=9) for i in range(3)]
    for r in reqs:
        sched.add(r)
    finished: list[Request] = []
    for _ in range(200):
        if not sched.has_work:
            break
        run_step(sched, finished)
    assert len(finished) == 3 and sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 9 for r in reqs)
    assert sched.blocks.num_free == 6


def test_only_running_request_that_cannot_grow_waits_instead_of_asserting():
    sched = Scheduler(BlockManager(2, 4), max_running=8, max_batched_tokens=64)
    req = make_request(1, 7, max_tokens=1)
    sched.add(req)
    finished: list[Request] = []
    for _ in range(5):
        run_step(sched, finished)
    assert finished == [req] and sched.blocks.num_free == 2


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(4, 40), budget=st.integers(16, 128),
       cap=st.integers(1, 8))
def test_random_workload_invariants(seed, num_blocks, budget, cap):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, max_running=cap, max_batched_tokens=budget)
    capacity = num_blocks * 4
    live, next_id = [], 0
    for _ in range(60):
        action = rng.random()
        if action < 0.3:
            prompt = rng.randrange(1, min(budget, capacity - 1) + 1)
            req = make_request(next_id, prompt, max_tokens=rng.randrange(1, max(2, capacity - prompt)))
            next_id += 1
            sched.add(req)
            live.append(req)
        elif action < 0.4 and live:
            victim = rng.choice(live)
            if not victim.finished:
                sched.finish(victim, pb.FINISH_REASON_ABORTED)
        step = run_step(sched)
        assert sum(n for _, n in step.scheduled()) <= budget
        assert len(sched.running) <= cap
        owned = [b for t in bm.tables.values() for b in t]
        assert len(owned) == len(set(owned)) and not set(owned) & set(bm._free)
        assert len(owned) + bm.num_free == num_blocks
        for req in sched.running:
            assert len(bm.tables[req.seq_id]) * 4 >= req.num_computed
        for req in live:
            if req.finished:
                assert req.seq_id not in bm.tables
    for req in live:
        if not req.finished:
            sched.finish(req, pb.FINISH_REASON_ABORTED)
    assert bm.num_free == num_blocks
