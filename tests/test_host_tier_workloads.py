"""The host KV tier under the scheduler (hypothesis): random workloads of submits, n = 2 forks,
cancels, data-plane crashes, speculative steps (drafts written, rejected ones cut back with
``BlockManager.truncate``) and preemptions (recompute and swap) on a tiny pool, host hits loaded or
recomputed by the cost rule (``headrace.controlplane.kv.tier_cost``, random estimates), played
against a simulated worker that holds both tiers' KV slot by slot and applies each step's swap-outs,
copy-on-write copies, swap-ins and forward writes in the workers' order: every sequence must read
exactly the KV of its own tokens, finish with the tokens of a run without offloading, and leave no
block of either tier behind."""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.tier_cost import TierCost
from headrace.v1 import inference_pb2 as pb
from tests.test_host_tier import _sched
from tests.test_scheduler import make_request


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


def _rule(policy, rng):
    if policy is None:
        return None
    # seconds per token: a block costs 0.04 to 2 to recompute, 0 to 2 to load
    return TierCost(policy, rng.uniform(0.0, 2.0), 4, recompute_s_per_token=rng.uniform(0.01, 0.5))


def _play(seed, blocks, host, mode, spec, crash, policy=None):
    rng = random.Random(seed)
    sched = _sched(blocks, host, mode, bs=4, budget=rng.choice([8, 16, 64]), cap=4, spec=spec,
                   cost=_rule(policy, random.Random(seed + 2)))
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
    assert not sched.has_work, "the scheduler stalled with work left (liveness)"
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
    sched.clock.now += 0.5   # deferred loads land after a few steps (a block costs up to 2 s)
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
# 7 blocks of 4 at least: the longest sequence (15 + 11 tokens) fits the pool, as the engine's
# max_model_len makes sure
@given(seed=st.integers(0, 100_000), blocks=st.integers(7, 24), host=st.integers(1, 24),
       mode=st.sampled_from(["recompute", "swap"]), spec=st.booleans(), crash=st.booleans(),
       policy=st.sampled_from([None, "auto", "auto", "never"]))
# stalled once: deferred sequences held every block, each needing one more, and nothing ran
@example(seed=70, blocks=6, host=6, mode="swap", spec=False, crash=True, policy=None)
def test_random_workloads_read_the_right_kv_and_match_a_run_without_offloading(seed, blocks, host, mode,
                                                                               spec, crash, policy):
    with_host = _play(seed, blocks, host, mode, spec, crash, policy)
    without = _play(seed, blocks, 0, "recompute", spec, crash)
    done = pb.FINISH_REASON_LENGTH   # (what an abort cut off depends on the progress made)
    both = [k for k in with_host if with_host[k][0] == done and without.get(k, (0,))[0] == done]
    assert [with_host[k] for k in both] == [without[k] for k in both]


