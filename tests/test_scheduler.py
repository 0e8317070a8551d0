"""Scheduler: policies, aging and the queue-delay guarantee, chunked prefill, preemption,
prefix sharing, parallel-sample forks, and invariants under random workloads (hypothesis)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.requests.request import Request, Sequence, Status
from headrace.controlplane.scheduling.scheduler import TIME_RECHECK_S, Scheduler
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


class _NoText:
    def step(self, token_id):
        return ""

    def flush(self):
        return ""


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


_ids = itertools.count(1)


def make_request(prompt, max_tokens=8, priority=0, n=1, arrival=0.0) -> Request:
    prompt = [3] * prompt if isinstance(prompt, int) else list(prompt)
    req = Request(request_id=str(next(_ids)), n=n, arrival=arrival)
    for i in range(n):
        req.sequences.append(Sequence(
            request=req, seq_id=next(_ids), index=i, prompt_token_ids=prompt, sampling=wpb.Sampling(),
            max_tokens=max_tokens, output=OutputText(_NoText(), []), priority=priority, arrival=arrival))
    return req


def run_step(sched: Scheduler, finished: list | None = None):
    """Schedules one step and plays the worker: sequences that reached their end sample."""
    step = sched.schedule()
    sched.after_step(step)
    for seq, _ in step.scheduled():
        if seq.num_inflight:               # it sampled: its token arrives
            seq.num_inflight -= 1
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq, pb.FINISH_REASON_LENGTH)
                if finished is not None:
                    finished.append(seq)
    return step


def drain(sched, limit=2000):
    finished = []
    for _ in range(limit):
        if not sched.has_work:
            return finished
        run_step(sched, finished)
    raise AssertionError("scheduler did not drain")


def sched_of(blocks=100, bs=4, cap=8, budget=64, policy=None, clock=None, prefix=True, watermark=0.0):
    return Scheduler(BlockManager(blocks, bs, prefix), cap, budget, policy or Policy(),
                     watermark=watermark, clock=clock or Clock())


def admitted(step):
    return [r.seq.request_id for r in step.new]


def test_fifo_admission_respects_budget_and_cap():
    sched = sched_of(cap=2, budget=20, prefix=False)
    reqs = [make_request(8) for _ in range(4)]
    for r in reqs:
        sched.add(r.sequences)
    step = sched.schedule()
    assert admitted(step) == [reqs[0].request_id, reqs[1].request_id]
    assert step.num_tokens == 16


def test_long_prompt_is_chunked_and_short_ones_are_computed_beside_its_chunks():
    sched = sched_of(budget=16)
    long, short = make_request(50), make_request(3)
    sched.add(long.sequences)
    sched.add(short.sequences)
    first = sched.schedule()   # the short prompt whole, the long one's chunk the rest
    assert [(r.seq.request_id, r.num_tokens) for r in first.new] == [(long.request_id, 13),
                                                                      (short.request_id, 3)]
    sched.after_step(first)
    later = make_request(list(range(100, 105)))   # arrives while the long prompt is chunked
    sched.add(later.sequences)
    second = sched.schedule()  # the short one decodes; the new one is computed in this step
    assert [(s.request_id, n) for s, n in zip(second.running.seqs, second.running.num_tokens)] \
        == [(short.request_id, 1), (long.request_id, 10)]
    assert [(r.seq.request_id, r.num_tokens) for r in second.new] == [(later.request_id, 5)]
    sched.after_step(second)
    sched.max_batched_tokens = 40
    third = sched.schedule()   # nobody else needs prompt tokens: the long one takes the rest
    assert dict((s.request_id, n) for s, n in zip(third.running.seqs, third.running.num_tokens)) \
        == {short.request_id: 1, later.request_id: 1, long.request_id: 27}


def test_priority_policy_orders_admission_and_keeps_priority_on_preemption():
    clock = Clock()
    sched = sched_of(cap=1, policy=Policy("priority", aging_rate=0.0), clock=clock)
    low, high = make_request(4, priority=5), make_request(4, priority=-1, arrival=1.0)
    sched.add(low.sequences)
    sched.add(high.sequences)
    assert admitted(sched.schedule()) == [high.request_id]


def test_sjf_prefers_the_shortest_remaining_work():
    sched = sched_of(cap=1, policy=Policy("sjf", aging_rate=0.0))
    big, small = make_request(40, max_tokens=100), make_request(4, max_tokens=4, arrival=1.0)
    sched.add(big.sequences)
    sched.add(small.sequences)
    assert admitted(sched.schedule()) == [small.request_id]


def test_aging_lets_a_starved_request_through():
    clock = Clock()
    sched = sched_of(cap=1, policy=Policy("priority", aging_rate=1.0), clock=clock)
    old = make_request(4, priority=10)
    sched.add(old.sequences)
    clock.now = 20.0                    # waited 20 s: rank 10 - 20 = -10
    fresh = make_request(4, priority=0, arrival=20.0)
    sched.add(fresh.sequences)
    assert admitted(sched.schedule()) == [old.request_id]


def test_max_queue_delay_admits_overdue_requests_first():
    clock = Clock()
    sched = sched_of(cap=1, policy=Policy("sjf", aging_rate=0.0, max_queue_delay=5.0), clock=clock)
    big = make_request(40, max_tokens=200)
    sched.add(big.sequences)
    clock.now = 6.0
    small = make_request(2, max_tokens=2, arrival=6.0)
    sched.add(small.sequences)
    assert admitted(sched.schedule()) == [big.request_id]


@pytest.mark.parametrize("policy,expect_victim", [("fifo", "newest"), ("priority", "low"), ("sjf", "long")])
def test_preemption_victim_follows_the_policy(policy, expect_victim):
    sched = sched_of(blocks=6, bs=4, cap=8, budget=64, policy=Policy(policy, aging_rate=0.0))
    reqs = {"low": make_request(7, max_tokens=10, priority=9, arrival=0.0),
            "newest": make_request(3, max_tokens=9, priority=0, arrival=2.0),
            "long": make_request(4, max_tokens=18, priority=0, arrival=1.0)}
    for r in reqs.values():
        sched.add(r.sequences)
    victims = []
    for _ in range(40):
        run_step(sched)
        victims = [name for name, r in reqs.items() if r.sequences[0].num_preemptions]
        if victims:
            break
    assert victims == [expect_victim]
    # and everything still finishes, with its tokens kept across preemption
    finished = drain(sched)
    assert {s.request_id for s in finished} <= {r.request_id for r in reqs.values()}
    assert all(len(r.sequences[0].output_token_ids) == r.sequences[0].max_tokens for r in reqs.values())
    assert sched.blocks.num_free == 6


def test_only_running_request_that_cannot_grow_waits_instead_of_asserting():
    sched = sched_of(blocks=2, bs=4)
    req = make_request(7, max_tokens=1)
    sched.add(req.sequences)
    assert drain(sched) == req.sequences and sched.blocks.num_free == 2


def test_same_prefix_admitted_in_one_step_shares_blocks():
    sched = sched_of(blocks=20, bs=4)
    prompt = list(range(10, 23))            # 13 tokens: 3 full blocks + 1
    a, b = make_request(prompt), make_request(prompt)
    sched.add(a.sequences)
    sched.add(b.sequences)
    step = sched.schedule()
    (sa, na, ta), (sb, nb, tb) = ((r.seq, r.num_tokens, r.block_ids) for r in step.new)
    assert (ta, tb) == (sched.blocks.block_ids(sa.seq_id), sched.blocks.block_ids(sb.seq_id))
    assert ta[:3] == tb[:3] and ta[3] != tb[3]
    assert (na, nb) == (13, 1) and sb.num_cached_prompt_tokens == 12
    assert sched.blocks.num_free == 20 - 5


def test_freed_prefix_stays_cached_until_evicted():
    sched = sched_of(blocks=8, bs=4)
    prompt = list(range(10, 19))            # 9 tokens: 2 full blocks
    first = make_request(prompt, max_tokens=1)
    sched.add(first.sequences)
    drain(sched)
    again = make_request(prompt, max_tokens=1)
    sched.add(again.sequences)
    step = sched.schedule()
    assert step.new[0].num_tokens == 1 and again.sequences[0].num_cached_prompt_tokens == 8
    drain(sched)
    other = make_request(list(range(100, 132)), max_tokens=1)   # needs all 8 blocks: evicts
    sched.add(other.sequences)
    drain(sched)
    late = make_request(prompt, max_tokens=1)
    sched.add(late.sequences)
    sched.schedule()
    assert late.sequences[0].num_cached_prompt_tokens == 0


def test_prefix_cache_can_be_disabled():
    sched = sched_of(blocks=20, bs=4, prefix=False)
    a, b = make_request(list(range(13))), make_request(list(range(13)))
    sched.add(a.sequences)
    sched.add(b.sequences)
    assert [r.num_tokens for r in sched.schedule().new] == [13, 13]


def test_parallel_samples_fork_with_copy_on_write():
    sched = sched_of(blocks=20, bs=4, prefix=False)
    req = make_request(list(range(10)), n=3, max_tokens=2)     # last prompt token in block 2
    sched.add(req.sequences)
    first = run_step(sched)
    assert [r.seq.index for r in first.new] == [0]
    second = sched.schedule()
    parent = req.sequences[0]
    children = [r.seq for r in second.new]
    assert [c.index for c in children] == [1, 2] and [r.num_tokens for r in second.new] == [1, 1]
    ptable = sched.blocks.block_ids(parent.seq_id)
    for child, record in zip(children, second.new):
        table = sched.blocks.block_ids(child.seq_id)
        assert record.block_ids == table
        assert child.num_cached_prompt_tokens == 8
        assert table[:2] == ptable[:2] and table[2] != ptable[2]
        assert child.num_computed == 9
    assert second.copies == [(ptable[2], sched.blocks.block_ids(c.seq_id)[2]) for c in children]
    sched.after_step(second)
    for seq, _ in second.scheduled():
        assert seq.num_inflight == 1
        seq.num_inflight -= 1
        seq.output_token_ids.append(7)
        if len(seq.output_token_ids) >= seq.max_tokens:
            sched.finish(seq, pb.FINISH_REASON_LENGTH)
    drain(sched)
    assert sched.blocks.num_free == 20


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(4, 40), budget=st.integers(1, 64),
       cap=st.integers(1, 8), policy=st.sampled_from(["fifo", "priority", "sjf"]),
       prefix=st.booleans(), delay=st.sampled_from([None, 3.0]))
def test_random_workload_invariants(seed, num_blocks, budget, cap, policy, prefix, delay):
    rng = random.Random(seed)
    clock = Clock()
    sched = sched_of(blocks=num_blocks, bs=4, cap=cap, budget=budget, clock=clock, prefix=prefix,
                     policy=Policy(policy, max_queue_delay=delay), watermark=0.1)
    bm, capacity = sched.blocks, num_blocks * 4
    live, mirror = [], set()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for _ in range(80):
        clock.now += 1.0
        r = rng.random()
        if r < 0.3:
            prompt = rng.choice(prefixes)[:rng.randrange(1, 12)] + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            prompt = prompt[:capacity - 1]
            req = make_request(prompt, max_tokens=rng.randrange(1, capacity - len(prompt) + 1),
                               priority=rng.randrange(-2, 3), n=rng.choice([1, 1, 2]), arrival=clock.now)
            sched.add(req.sequences)
            live.append(req)
        elif r < 0.4 and live:
            for seq in rng.choice(live).sequences:
                if not seq.finished:
                    sched.finish(seq, pb.FINISH_REASON_ABORTED)
        overdue = [s for s in sched.waiting if delay and clock.now - s.waiting_since >= delay]
        step = run_step(sched)
        if not step.empty:   # the worker's mirror changes only with the steps it is sent
            mirror -= set(step.finished_seq_ids)
            mirror |= {r.seq.seq_id for r in step.new}
            for r in step.new:   # a new sequence arrives with its whole table
                if r.seq.status is Status.RUNNING:   # (not finished by this step)
                    assert r.block_ids == bm.block_ids(r.seq.seq_id)
            running = step.running
            assert len(running.seqs) == len(running.num_tokens) == len(running.new_block_counts)
            assert sum(running.new_block_counts) == len(running.new_block_ids)
            at = 0
            for seq, count in zip(running.seqs, running.new_block_counts):   # tables only grow at the end
                if count and seq.status is Status.RUNNING:
                    assert bm.block_ids(seq.seq_id)[-count:] == tuple(running.new_block_ids[at:at + count])
                at += count
        running_ids = {s.seq_id for s in sched.running}
        assert mirror <= running_ids | set(sched._forget), "a worker would hold a dropped sequence"
        assert running_ids - {s.seq_id for s in sched.forks.unsent} <= mirror
        assert len(mirror - set(sched._forget)) <= cap
        # the token budget and the cap hold
        assert step.num_tokens <= budget and len(sched.running) <= cap
        # an overdue sequence is never passed over by one that is not
        if overdue and step.new:
            first_new = step.new[0].seq
            assert first_new in overdue or first_new.num_computed == first_new.num_tokens - 1
        # reference counts equal owners; nothing is both free and owned; nothing is lost
        owners = {}
        all_seqs = [seq for req in live for seq in req.sequences]
        for seq in all_seqs:
            for b in bm.block_ids(seq.seq_id):
                owners[b] = owners.get(b, 0) + 1
        assert all(bm.ref[b] == owners.get(b, 0) for b in range(num_blocks))
        assert set(bm._free) == {b for b in range(num_blocks) if bm.ref[b] == 0}
        for seq in sched.running:
            assert bm.num_slots(seq.seq_id) >= seq.num_computed
        for req in live:
            for seq in req.sequences:
                if seq.finished:
                    assert bm.block_ids(seq.seq_id) == ()
    drain(sched, limit=20_000)   # liveness: every request left finishes (one token a step at worst)
    assert all(seq.finished for req in live for seq in req.sequences)
    assert bm.num_free == num_blocks and not any(bm.ref)


def test_sequences_to_forget_wait_for_a_step_that_is_sent():
    sched = sched_of()
    req = make_request(4, max_tokens=1)
    sched.add(req.sequences)
    run_step(sched)                       # finishes: the workers must forget it
    assert sched.schedule().empty         # nothing to run: this step is not sent
    other = make_request(4, max_tokens=1)
    sched.add(other.sequences)
    assert sched.schedule().finished_seq_ids == [req.sequences[0].seq_id]


def test_a_step_that_preempts_admits_nobody():
    sched = sched_of(blocks=18, bs=4, cap=8, budget=16, prefix=False)
    a = make_request(8, max_tokens=40, arrival=0.0)
    b = make_request(60, max_tokens=8, arrival=1.0)
    sched.add(a.sequences)
    sched.add(b.sequences)
    for _ in range(60):
        before = sched.num_preemptions
        step = run_step(sched)
        if sched.num_preemptions > before:
            assert not step.new, "a victim was readmitted in the step that preempted it"
    drain(sched)
    assert sched.blocks.num_free == 18


def test_retry_after_is_set_only_when_time_can_let_waiting_work_in():
    for policy, expect in [(Policy("fifo"), None), (Policy("priority"), TIME_RECHECK_S),
                           (Policy("fifo", max_queue_delay=2.0), TIME_RECHECK_S),
                           (Policy("sjf", aging_rate=0.0), None)]:
        sched = sched_of(policy=policy)
        assert sched.retry_after is None   # nothing waits
        sched.add(make_request(4).sequences)
        assert sched.retry_after == expect


def test_reset_requeues_running_work_and_forgets_the_prefix_cache():
    sched = sched_of(blocks=20, bs=4)
    prompt = list(range(10, 23))
    req = make_request(prompt, max_tokens=4)
    sched.add(req.sequences)
    run_step(sched)
    seq = req.sequences[0]
    assert seq in sched.running and seq.output_token_ids == [7]
    sched.reset()
    assert sched.running == [] and sched.waiting == [seq] and sched.blocks.num_free == 20
    assert seq.num_computed == 0 and not seq.on_worker and seq.num_inflight == 0
    assert sched.blocks.match_prefix(prompt) == []
    step = sched.schedule()   # recomputes prompt and generated token; the workers forget nothing
    assert [(r.seq, r.num_tokens) for r in step.new] == [(seq, 14)] and step.finished_seq_ids == []


def test_reconfigure_validates_and_keeps_what_is_not_given():
    sched = sched_of(cap=3, budget=20)
    with pytest.raises(ValueError):
        sched.reconfigure(max_running=0)
    with pytest.raises(ValueError):
        sched.reconfigure(max_batched_tokens=0)
    sched.reconfigure(max_running=5)
    assert (sched.max_running, sched.max_batched_tokens) == (5, 20)
    sched.reconfigure(policy=Policy("sjf"), max_batched_tokens=7)
    assert (sched.policy.name, sched.max_running, sched.max_batched_tokens) == ("sjf", 5, 7)
