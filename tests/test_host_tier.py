"""The host KV tier's bookkeeping (controlplane.host_tier through the block manager and the
scheduler): offload on eviction, prefix hits from the host, swap preemption, pins, resets;
and a hypothesis property test that plays the workers' KV cache, both tiers, block by block
(swap-outs, swap-ins, copy-on-write copies, forward writes, speculative drafts), checking that
every sequence reads exactly the KV of its own tokens, that its outputs equal a run without
offloading, and that no block of either tier leaks or is handed out while referenced."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from common import speculative
from controlplane.block_manager import BlockManager
from controlplane.policy import Policy
from controlplane.request import Status
from controlplane.scheduler import Scheduler
from controlplane.speculation import Speculation
from headrace.v1 import inference_pb2 as pb
from tests.test_scheduler import Clock, make_request, run_step


def _sched(blocks, host, mode="recompute", bs=4, budget=64, cap=8, spec=False):
    sched = Scheduler(BlockManager(blocks, bs, True, host_blocks=host), cap, budget, Policy(),
                      watermark=0.0, clock=Clock(), preemption_mode=mode)
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


# -- the property test: a simulated worker holds the KV of both tiers -------------------------
def _next_token(tokens) -> int:
    return hash(tuple(tokens)) % 5


class SimWorker:
    """Both tiers' KV, per slot: the tuple of tokens whose last one the slot holds the KV of."""

    def __init__(self, bs):
        self.bs, self.dev, self.host, self.tables = bs, {}, {}, {}

    def crash(self):
        self.dev.clear()
        self.host.clear()
        self.tables.clear()

    def _copy(self, src, s, dst, d):
        for o in range(self.bs):
            dst[(d, o)] = src.get((s, o))

    def apply(self, step, rng, spec_out):
        for sid in step.finished_seq_ids:
            self.tables.pop(sid, None)
        for sid, n in step.truncations:
            del self.tables[sid][n:]
        for d, h in step.swap_out:
            self._copy(self.dev, d, self.host, h)
        for s, d in step.copies:
            self._copy(self.dev, s, self.dev, d)
        for h, d in step.swap_in:
            self._copy(self.host, h, self.dev, d)
        for r in step.new:
            self.tables[r.seq.seq_id] = list(r.block_ids)
        at = 0
        for seq, count in zip(step.running.seqs, step.running.new_block_counts):
            self.tables[seq.seq_id].extend(step.running.new_block_ids[at:at + count])
            at += count
        specs = dict(zip((s.seq_id for s in step.running.seqs), step.running.num_spec))
        # a layer's forward writes every token's KV, then attends: a sequence admitted on a
        # block that another one fills in the same step reads it complete
        for seq, n in step.scheduled():
            table, tokens, start = self.tables[seq.seq_id], seq.token_ids, seq.num_computed
            k = specs.get(seq.seq_id, 0)
            drafts = [rng.choice([_next_token(tokens), rng.randrange(5)]) for _ in range(k)]
            stream = tokens + drafts
            for p in range(start, start + n + k):
                self.dev[(table[p // self.bs], p % self.bs)] = tuple(stream[:p + 1])
            if k:
                accepted = 0
                while accepted < k and drafts[accepted] == _next_token(stream[:start + 1 + accepted]):
                    accepted += 1
                spec_out[seq.seq_id] = (k, accepted)
        for seq, n in step.scheduled():   # what the forward reads: the KV of exactly its tokens
            table, tokens = self.tables[seq.seq_id], seq.token_ids
            for p in range(seq.num_computed + n):
                got = self.dev.get((table[p // self.bs], p % self.bs))
                assert got == tuple(tokens[:p + 1]), f"seq {seq.seq_id} reads wrong KV at {p}"


def _play(seed, blocks, host, mode, spec, crash):
    rng = random.Random(seed)
    sched = _sched(blocks, host, mode, bs=4, budget=rng.choice([8, 16, 64]), cap=4, spec=spec)
    bm, worker, live, outputs = sched.blocks, SimWorker(4), [], {}
    prompts = [[rng.randrange(5) for _ in range(10)] for _ in range(3)]
    plan = random.Random(seed + 1)   # the workload does not depend on what the tiers do
    for i in range(70):
        r = plan.random()
        if r < 0.3:
            prompt = plan.choice(prompts)[:plan.randrange(1, 11)] + [plan.randrange(5) for _ in range(plan.randrange(0, 6))]
            req = make_request(prompt, max_tokens=plan.randrange(1, 12), n=plan.choice([1, 1, 2]))
            for s in req.sequences:
                s.sampling.repetition_penalty = 1.0
            req.key = i
            sched.add(req.sequences)
            live.append(req)
        elif r < 0.38 and live:
            for seq in plan.choice(live).sequences:
                if not seq.finished:
                    sched.finish(seq, pb.FINISH_REASON_ABORTED)
        elif r < 0.41 and crash:
            sched.reset()
            worker.crash()
        _step(sched, worker, rng)
        _check(sched, bm, live)
    for _ in range(3000):
        if not sched.has_work:
            break
        _step(sched, worker, rng)
        _check(sched, bm, live)
    for req in live:
        for seq in req.sequences:
            if not seq.finished:
                sched.finish(seq, pb.FINISH_REASON_ABORTED)
            outputs[(req.key, seq.index)] = (seq.finish_reason, list(seq.output_token_ids))
    assert bm.num_free == blocks and not any(bm.ref), "a device block leaked"
    if bm.host is not None:
        bm.take_ops()
        assert not any(bm.host.ref) and not bm.host.swapped, "a host block leaked"
        assert bm.host.num_free == host
    return outputs


def _step(sched, worker, rng):
    step = sched.schedule(speculate=sched.may_speculate())
    if step.empty:
        return
    spec_out = {}
    worker.apply(step, rng, spec_out)
    sched.after_step(step)
    for seq, _ in step.scheduled():
        if not seq.num_inflight:
            continue
        seq.num_inflight -= 1
        given, accepted = spec_out.get(seq.seq_id, (0, 0))
        for j in range(accepted + 1):
            seq.output_token_ids.append(_next_token(seq.token_ids))
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq, pb.FINISH_REASON_LENGTH)
                break
        if given:
            sched.verified(seq, given, given, accepted)


def _check(sched, bm, live):
    owners = {}
    for req in live:
        for seq in req.sequences:
            for b in bm.block_ids(seq.seq_id):
                owners[b] = owners.get(b, 0) + 1
            if seq.finished:
                assert not bm.block_ids(seq.seq_id) and not bm.is_swapped(seq.seq_id)
    assert all(bm.ref[b] == owners.get(b, 0) for b in range(bm.num_blocks)), "a device block's count is off"
    assert set(bm._free) == {b for b in range(bm.num_blocks) if bm.ref[b] == 0}
    host = bm.host
    if host is not None:
        holders = {}
        for blocks in host.swapped.values():
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in host._pinned:
            holders[b] = holders.get(b, 0) + 1
        assert all(host.ref[b] == holders.get(b, 0) for b in range(host.num_blocks)), "a host block's count is off"
        assert set(host._free) == {b for b in range(host.num_blocks) if host.ref[b] == 0}
        for h, b in host.cached.items():
            assert host._hash[b] == h


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 100_000), blocks=st.integers(6, 24), host=st.integers(1, 24),
       mode=st.sampled_from(["recompute", "swap"]), spec=st.booleans(), crash=st.booleans())
def test_random_workloads_read_the_right_kv_and_match_a_run_without_offloading(seed, blocks, host, mode,
                                                                               spec, crash):
    with_host = _play(seed, blocks, host, mode, spec, crash)
    without = _play(seed, blocks, 0, "recompute", spec, crash)
    done = pb.FINISH_REASON_LENGTH   # (what an abort cut off depends on the progress made)
    both = [k for k in with_host if with_host[k][0] == done and without.get(k, (0,))[0] == done]
    assert [with_host[k] for k in both] == [without[k] for k in both]


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
