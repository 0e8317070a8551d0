"""The host KV tier's bookkeeping (headrace.controlplane.kv.host_tier through the block manager and
the scheduler): offload on eviction, prefix hits from the host, swap preemption, pins, resets; and a
hypothesis property test of the block manager alone over a simulated KV of both tiers (no block
leaks or is handed out while referenced; every sequence reads its own tokens' KV). Random workloads
through the scheduler: tests/test_host_tier_workloads.py."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.common import speculative
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.requests.request import Status
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.controlplane.engine.speculation import Speculation
from tests.test_scheduler import Clock, make_request, run_step


def _sched(blocks, host, mode="recompute", bs=4, budget=64, cap=8, spec=False, cost=None):
    sched = Scheduler(BlockManager(blocks, bs, True, host_blocks=host), cap, budget, Policy(),
                      watermark=0.0, clock=Clock(), preemption_mode=mode, tier_cost=cost)
    if spec:
        cfg = speculative.parse('{"method": "ngram", "num_speculative_tokens": 3}')
        sched.speculation = Speculation(cfg, 10_000)
    return sched


def _run(sched, prompt, max_tokens=1):
    req = make_request(prompt, max_tokens=max_tokens)
    sched.add(req.sequences)
    steps = []
    while not req.sequences[0].finished:
        steps.append(run_step(sched))
    return req.sequences[0], steps


def test_an_evicted_cached_block_is_offloaded_and_a_later_hit_copies_it_back():
    sched = _sched(blocks=4, host=8)
    first, steps = _run(sched, list(range(1, 10)))          # 9 tokens: 2 full blocks + 1
    assert sum(len(s.swap_out) for s in steps) == 0
    _, steps = _run(sched, list(range(50, 64)))              # takes every device block
    outs = [p for s in steps for p in s.swap_out]
    assert len(outs) == 2 and len(sched.blocks.host.cached) == 2   # both full blocks saved
    seq, steps = _run(sched, list(range(1, 10)))
    ins = steps[0].swap_in
    assert sorted(h for h, _ in ins) == sorted(h for _, h in outs)   # read back from where they went
    assert seq.num_cached_prompt_tokens == 8 and sched.blocks.host.hits == 8
    assert tuple(d for _, d in ins) == steps[0].new[0].block_ids[:2]


def test_a_host_hit_is_pinned_until_its_step_is_taken():
    bm = BlockManager(2, 2, True, host_blocks=1)
    bm.grow(1, 2)
    bm.register(1, lambda: [5, 6], 2)
    bm.free(1)
    bm.grow(2, 4)                         # evicts block 0 to the host
    assert bm.take_ops()[0] == [(0, 0)]
    bm.free(2)
    hits = bm.match_prefix([5, 6, 7])
    assert hits == [~0]
    bm.adopt(3, hits, 3)
    assert bm.host.ref[0] == 1 and bm.host.num_free == 0
    bm.grow(4, 2)                         # evicting again cannot take the pinned host block
    out, into = bm.take_ops()
    assert out == [] and len(into) == 1 and bm.host.ref[0] == 0


def test_swap_preemption_keeps_the_kv_on_the_host_and_resumes_without_recompute():
    sched = _sched(blocks=4, host=8, mode="swap", budget=16)
    a = make_request(list(range(1, 8)), max_tokens=8)      # 7 + 8 tokens: 4 blocks at the end
    b = make_request(list(range(20, 27)), max_tokens=8)
    sched.add(a.sequences)
    sched.add(b.sequences)
    swapped, computed = [], 0
    for _ in range(200):
        if not sched.has_work:
            break
        step = run_step(sched)
        for seq in (a.sequences[0], b.sequences[0]):
            if seq.status is Status.WAITING and seq.num_preemptions and sched.blocks.is_swapped(seq.seq_id):
                swapped.append(seq)
        for r in step.new:
            if r.seq.num_preemptions:
                computed += r.seq.num_computed
                assert step.swap_in
    assert sched.num_preemptions and swapped and computed > 0
    assert sched.blocks.num_free == 4 and sched.blocks.host.num_free == 8 and not sched.blocks.host.swapped


def test_a_reset_forgets_both_tiers_and_swapped_sequences_recompute():
    sched = _sched(blocks=4, host=8, mode="swap")
    _run(sched, list(range(1, 10)))
    _run(sched, list(range(50, 62)))
    assert sched.blocks.host.cached
    req = make_request(list(range(1, 10)), max_tokens=2)
    sched.add(req.sequences)
    sched.reset()
    assert not sched.blocks.host.cached and sched.blocks.match_prefix(list(range(1, 10))) == []
    assert sched.blocks.host.num_free == 8


def test_an_unknown_preemption_mode_is_refused():
    import pytest
    with pytest.raises(ValueError, match="preemption mode"):
        _sched(blocks=4, host=0, mode="spill")


# -- the block manager alone, driven directly ---------------------------------------------------
OPS = ["compute"] * 4 + ["admit"] * 3 + ["step"] * 3 + ["fork", "truncate", "free", "preempt", "resume"]


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 16), host_blocks=st.integers(1, 16), seed=st.integers(0, 1 << 30))
def test_block_manager_with_a_host_tier_never_leaks_nor_hands_out_a_referenced_block(num_blocks, host_blocks,
                                                                                     seed):
    """Sequences ``0..5`` over three token streams that share prefixes; every op at the block
    manager's level as the scheduler calls it (``swap_out`` then ``free`` for a preemption,
    ``truncate`` of unregistered tail blocks, ``fork`` with its copy), the copies applied to a
    simulated KV at each step boundary (``take_ops``), then every live sequence's computed
    tokens are read back."""
    bs = 2
    bm = BlockManager(num_blocks, bs, True, host_blocks=host_blocks)
    streams = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [1, 2, 3, 4, 9, 9, 9, 9] * 4, [5, 6] * 16]
    tokens, computed, swapped, pending = {}, {}, {}, []   # pending: (seq, start, end, table) writes
    copies: list = []
    dev, host = {}, {}

    def step():
        out, into = bm.take_ops()
        for d, h in out:
            for o in range(bs):
                host[(h, o)] = dev.get((d, o))
        for s, d in copies:
            for o in range(bs):
                dev[(d, o)] = dev.get((s, o))
        copies.clear()
        for h, d in into:
            for o in range(bs):
                dev[(d, o)] = host.get((h, o))
        for seq, start, end, table in pending:   # a step once built is sent: a sequence
            for p in range(start, end):          # freed meanwhile is still computed by it
                dev[(table[p // bs], p % bs)] = tuple(tokens[seq][:p + 1])
        pending.clear()
        for seq, n in computed.items():
            table = bm.block_ids(seq)
            for p in range(n):
                assert dev.get((table[p // bs], p % bs)) == tuple(tokens[seq][:p + 1]), (seq, p)

    rng = random.Random(seed)
    for _ in range(150):
        op, seq, n = rng.choice(OPS), rng.randrange(6), rng.randrange(1, 12)
        live = seq in computed
        # a sequence in the step being built is not preempted, forked from or cut back before
        # that step is sent (the scheduler's victims are never scheduled ones; forks and
        # truncations follow a step's result)
        idle = live and all(w[0] != seq for w in pending)
        if op == "admit" and not live and seq not in swapped:
            tokens[seq] = streams[seq % 3][:8 + seq * 3]
            hits = bm.match_prefix(tokens[seq])
            cached = bm.cached_tokens(hits)
            if bm.cost(hits, cached + 1) <= bm.num_free:
                bm.adopt(seq, hits, len(tokens[seq]))
                bm.grow(seq, cached + 1)
                bm.register(seq, lambda: tokens[seq], cached + 1)
                pending.append((seq, cached, cached + 1, bm.block_ids(seq)))
                computed[seq] = cached + 1
        elif op == "compute" and live:
            end = min(len(tokens[seq]), computed[seq] + n)
            if end > computed[seq] and bm.can_grow(seq, end):
                bm.grow(seq, end)
                bm.register(seq, lambda: tokens[seq], end)
                pending.append((seq, computed[seq], end, bm.block_ids(seq)))
                computed[seq] = end
        elif op == "fork" and idle and (child := seq + 6) not in computed and child not in swapped \
                and bm.num_free >= 1 and computed[seq] >= 2:
            position = computed[seq] - 1       # the child recomputes the parent's last token
            pair, shared = bm.fork(seq, child, position)
            copies.append(pair)
            tokens[child] = tokens[seq]
            pending.append((child, position, position + 1, bm.block_ids(child)))
            computed[child] = position + 1
        elif op == "truncate" and idle and bm.can_grow(seq, computed[seq] + n):
            bm.grow(seq, computed[seq] + n)     # speculative positions, never registered
            assert bm.truncate(seq, computed[seq]) is not None or n <= bm.num_slots(seq) - computed[seq]
        elif op == "free" and live:
            if not idle:   # an abort comes between steps: the step computing it was sent
                step()
            bm.free(seq)
            del computed[seq]
        elif op == "preempt" and idle:
            if bm.swap_out(seq, computed[seq]):
                swapped[seq] = computed[seq]
            bm.free(seq)
            del computed[seq]
        elif op == "resume" and seq in swapped and bm.num_free >= bm.swap_in_cost(seq, swapped[seq]):
            bm.swap_in(seq, swapped[seq])
            computed[seq] = swapped.pop(seq)
            bm.register(seq, lambda: tokens[seq], computed[seq])
            pending.append((seq, 0, 0, ()))   # it is in this step
        elif op == "step":
            step()
        # counts: device references are the tables', host ones the swapped tables' and the pins
        owners = {}
        for s in computed:
            for b in bm.block_ids(s):
                owners[b] = owners.get(b, 0) + 1
        assert all(bm.ref[b] == owners.get(b, 0) for b in range(num_blocks))
        assert set(bm._free) == {b for b in range(num_blocks) if bm.ref[b] == 0}
        holds = {}
        for blocks in bm.host.swapped.values():
            for b in blocks:
                holds[b] = holds.get(b, 0) + 1
        for b in bm.host._pinned:
            holds[b] = holds.get(b, 0) + 1
        assert all(bm.host.ref[b] == holds.get(b, 0) for b in range(host_blocks))
        assert set(bm.host.swapped) == set(swapped)
    step()
    for s in list(computed):
        bm.free(s)
    for s in list(swapped):
        bm.drop_swapped(s)
    bm.take_ops()
    assert bm.num_free == num_blocks and not any(bm.ref), "a device block leaked"
    assert bm.host.num_free == host_blocks and not any(bm.host.ref), "a host block leaked"
