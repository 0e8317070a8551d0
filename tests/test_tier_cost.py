"""The host KV tier's cost rule (headrace.controlplane.kv.tier_cost): the recompute price is the
slope of the data plane's prefill profile whatever a step's fixed cost, and the slowest rank's;
``cut`` adopts the prefix that costs least (a host block loaded only where that is cheaper than
recomputing it), checked against brute force; through the scheduler a host hit is loaded when the
copy is cheap and recomputed when it is dear, the host copy staying cached, with the same tokens
either way. Random workloads with the rule on: tests/test_host_tier_workloads.py; end to end on CPU
(the worker's measured profile and rate): tests/test_kv_offload.py."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.kv.tier_cost import TierCost, prefill_slope
from tests.test_host_tier import _run, _sched


@settings(max_examples=60, deadline=None)
@given(slope=st.floats(1e-7, 1e-3), overhead=st.floats(0.0, 0.05),
       sizes=st.lists(st.integers(1, 16384), min_size=2, max_size=6, unique=True))
def test_the_slope_is_the_cost_of_one_more_token_whatever_the_fixed_cost(slope, overhead, sizes):
    assert prefill_slope(sizes, [overhead + slope * n for n in sizes]) == pytest.approx(slope, rel=1e-6)


def test_a_profile_of_one_size_or_a_falling_one_prices_nothing():
    assert prefill_slope([1024], [0.01]) is None
    assert prefill_slope([1024, 1024], [0.01, 0.02]) is None
    assert prefill_slope([512, 1024], [0.02, 0.01]) is None
    assert prefill_slope([], []) is None
    assert prefill_slope([0, 512, 1024], [0.5, 0.01, 0.02]) == pytest.approx(0.01 / 512)


def test_a_prefill_heavy_profile_is_priced_by_its_slope_not_by_its_average():
    """Session 8's rule averaged whole steps and priced Qwen3-0.6B's recompute at 78-96 us per
    token; a profile with a 5 ms fixed part and 3 us per token is priced at 3."""
    tokens = [1024, 2048, 4096, 8192]
    seconds = [0.005 + 3e-6 * n for n in tokens]
    assert prefill_slope(tokens, seconds) == pytest.approx(3e-6)
    assert seconds[0] / tokens[0] > 7e-6   # what time over tokens would say at 1,024


def _info(rate=27e9, block=1_835_008, tokens=(1024, 8192), seconds=(0.004, 0.025)):
    return types.SimpleNamespace(host_kv_load_bytes_per_s=rate, kv_bytes_per_block=block,
                                 prefill_profile_tokens=list(tokens), prefill_profile_seconds=list(seconds))


def test_the_rule_for_a_worker_group_takes_the_slowest_copy_and_the_steepest_prefill():
    blocks = BlockManager(8, 16, True, host_blocks=4)
    rule = TierCost.for_workers("auto", [_info(), _info(rate=20e9, tokens=(1024, 8192), seconds=(0.004, 0.039))],
                                blocks)
    assert rule.load_s_per_block == pytest.approx(1_835_008 / 20e9)
    assert rule.recompute_s_per_token == pytest.approx(0.035 / 7168)
    assert rule.profile == [(1024, 0.004), (8192, 0.039)]
    assert rule.loads() is False   # 5.7 us to load a token, 4.9 to recompute it
    assert TierCost.for_workers("auto", [_info()], BlockManager(8, 16, True)) is None   # no host tier
    unmeasured = TierCost.for_workers("auto", [_info(rate=0.0, tokens=(), seconds=())], blocks)
    assert unmeasured.load_s_per_block is None and unmeasured.recompute_s_per_token is None
    assert unmeasured.cut([~0, ~1]) == 2 and unmeasured.loads() is None   # loads: it cannot know


def _rule(load_s_per_block, recompute_s_per_token, bs=4, policy="auto"):
    return TierCost(policy, load_s_per_block, bs, recompute_s_per_token)


@settings(max_examples=300, deadline=None)
@given(hits=st.lists(st.booleans(), max_size=12), load=st.floats(0.0, 10.0),
       recompute=st.floats(0.01, 10.0))
def test_cut_adopts_the_cheapest_prefix(hits, load, recompute):
    blocks = [~i if on_host else i for i, on_host in enumerate(hits)]
    rule = _rule(load, recompute / 4, bs=4)
    k = rule.cut(blocks)

    def cost(j):
        return load * sum(1 for b in blocks[:j] if b < 0) + recompute * (len(blocks) - j)

    assert cost(k) <= min(cost(j) for j in range(len(blocks) + 1)) + 1e-9
    assert all(cost(j) > cost(k) - 1e-9 for j in range(k))   # ties: the shorter (recompute)
    if all(hits) and hits:
        assert k == (len(blocks) if load < recompute else 0)


def test_cut_by_policy_and_before_anything_is_known():
    hits = [0, 1, ~5, 2, ~6]
    assert _rule(1.0, 1e-9, policy="always").cut(hits) == 5
    assert _rule(1e-9, 1.0, policy="never").cut(hits) == 2
    assert _rule(None, 1.0).cut(hits) == 5        # no copy rate measured: loads
    assert _rule(1.0, None).cut(hits) == 5        # no prefill profile: loads
    assert _rule(1.0, 1e-9).cut([0, 1, 2]) == 3   # device hits only: all of them
    dear = _rule(1.0, 1.0 / 4 * 0.9)              # a host block dearer than its 4 tokens
    assert dear.cut([0, 1, ~5, ~6]) == 2
    assert dear.cut(hits) == 4                    # ... but worth it for the device hit after it
    assert _rule(1.0, 1.0 / 4 * 0.3).cut([~0, 1, 2]) == 0   # 3 blocks recomputed: cheaper
    assert _rule(1.0, 1.0 / 4 * 0.4).cut([~0, 1, 2]) == 3   # 3 blocks recomputed: dearer
    with pytest.raises(ValueError, match="kv-offloading-policy"):
        TierCost("sometimes")


def _evicted_then_hit(rule):
    """A 9-token prompt's 2 full blocks are evicted to the host by another prompt; the same
    prompt again: its blocks are on the host."""
    sched = _sched(blocks=4, host=8, cost=rule)
    first, _ = _run(sched, list(range(1, 10)), max_tokens=3)
    _run(sched, list(range(50, 64)))
    assert len(sched.blocks.host.cached) == 2
    sched.saved = dict(sched.blocks.host.cached)
    again, steps = _run(sched, list(range(1, 10)), max_tokens=3)
    return sched, first, again, steps


def test_a_cheap_copy_loads_the_host_hit():
    sched, first, again, steps = _evicted_then_hit(_rule(1e-6, 1e-3))
    assert len(steps[0].swap_in) == 2 and steps[0].new[0].num_tokens == 1
    assert again.num_cached_prompt_tokens == 8 and sched.blocks.host.hits == 8
    assert sched.tier_cost.skipped_tokens == 0
    assert again.output_token_ids == first.output_token_ids


def test_a_dear_copy_recomputes_and_leaves_the_host_copy_cached():
    sched, first, again, steps = _evicted_then_hit(_rule(1e-3, 1e-6))
    assert not any(s.swap_in for s in steps) and steps[0].new[0].num_tokens == 9
    assert again.num_cached_prompt_tokens == 0 and sched.blocks.host.hits == 0
    assert sched.tier_cost.skipped_tokens == 8
    host = sched.blocks.host
    assert sched.saved.items() <= host.cached.items() and not any(host.ref)   # kept, unpinned
    assert again.output_token_ids == first.output_token_ids
    # the recomputed blocks are the device's cached copies now: a third run hits them there
    third, steps = _run(sched, list(range(1, 10)))
    assert third.num_cached_prompt_tokens == 8 and not steps[0].swap_in


def test_the_rule_and_its_verdict_are_logged_at_start(caplog):
    from headrace.controlplane.kv import host_tier

    rule = TierCost.for_workers("auto", [_info(rate=1_835_008 / (4.2e-6 * 16), tokens=(1024, 8192),
                                               seconds=(0.004, 0.004 + 7168 * 2.9e-6))],
                                BlockManager(8, 16, True, host_blocks=4))
    with caplog.at_level("INFO", logger="headrace.engine"):
        host_tier.report(BlockManager(8, 16, True, host_blocks=4), "recompute", rule)
    line = caplog.records[0].getMessage()
    assert "offloading policy auto, host load 4.20 us/token, recompute 2.90 us/token" in line
    assert "1024: 4.00 ms" in line and "host hits are recomputed, evicted blocks not written back" in line


def test_auto_that_recomputes_lone_hits_writes_no_evicted_block_back():
    dear = _rule(1.0, 1.0 / 4 * 0.9)
    assert not dear.keeps_evicted()
    assert _rule(1.0, 1.0).keeps_evicted() and _rule(None, 1.0).keeps_evicted()   # loads; unknown
    assert _rule(1.0, 1e-9, policy="always").keeps_evicted()
    assert _rule(1e-9, 1.0, policy="never").keeps_evicted()   # never: hits found, then recomputed
    sched = _sched(blocks=4, host=8, cost=dear)
    sched.blocks.offload_evicted = dear.keeps_evicted()
    _run(sched, list(range(1, 10)), max_tokens=3)
    _, steps = _run(sched, list(range(50, 64)))   # evicts the first prompt's blocks: dropped
    assert not any(s.swap_out for s in steps) and not sched.blocks.host.cached


def test_the_engine_sets_the_write_back_from_the_workers_measurements():
    from headrace.controlplane.engine.loop import Engine, EngineConfig
    from headrace.worker.v1 import worker_pb2 as wpb

    engine = Engine(types.SimpleNamespace(num_kv_blocks=64), EngineConfig(kv_offloading_policy="auto"))

    def info(rate):
        return wpb.WorkerInfo(block_size=16, num_host_kv_blocks=32, kv_bytes_per_block=1 << 20,
                              max_model_len=4096, host_kv_load_bytes_per_s=rate,
                              prefill_profile_tokens=[1024, 8192], prefill_profile_seconds=[0.004, 0.025])
    engine._build([info(1e12)])   # 1 us a block: loads
    assert engine.scheduler.blocks.offload_evicted and engine.scheduler.tier_cost.loads()
    engine._build([info(1e9)])    # 1 ms a block against 47 us of prefill: recomputes
    assert not engine.scheduler.blocks.offload_evicted and engine.scheduler.tier_cost.loads() is False
