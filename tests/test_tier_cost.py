"""The host KV tier's cost rule (controlplane.tier_cost): the step-time fit recovers the
marginal cost of a token whatever a step's fixed cost; ``cut`` adopts the prefix that costs
least (a host block loaded only where that is cheaper than recomputing it), checked against
brute force; through the scheduler a host hit is loaded when the copy is cheap and
recomputed when it is dear, the host copy staying cached, with the same tokens either way.
Random workloads with the rule on: tests/test_host_tier_workloads.py; end to end on CPU:
tests/test_kv_offload.py."""

from __future__ import annotations

import random
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.scheduler import Scheduler
from controlplane.step import ScheduledStep
from controlplane.tier_cost import MIN_STEPS, StepFit, TierCost
from tests.test_host_tier import _run, _sched


def _fitted(slope_s: float, overhead_s: float = 0.0, seed: int = 0) -> StepFit:
    fit, rng = StepFit(), random.Random(seed)
    for _ in range(200):
        n = rng.choice([1, 8, 64, 256, 1024, 2048])
        fit.observe(n, overhead_s + slope_s * n)
    return fit


@settings(max_examples=60, deadline=None)
@given(slope=st.floats(1e-7, 1e-3), overhead=st.floats(0.0, 0.05), seed=st.integers(0, 1000))
def test_the_fit_finds_the_cost_of_one_more_token_whatever_the_fixed_cost(slope, overhead, seed):
    assert _fitted(slope, overhead, seed).slope == pytest.approx(slope, rel=1e-6)


def test_the_fit_waits_for_varied_steps_and_keeps_its_estimate_through_alike_ones():
    fit = StepFit()
    for _ in range(100):
        fit.observe(2048, 0.01)        # all alike: no slope to see
    assert fit.slope is None
    fit = _fitted(3e-6, 0.005)
    for _ in range(1000):
        fit.observe(2048, 0.005 + 3e-6 * 2048)   # the spread is forgotten: the slope stays
    assert fit.slope == pytest.approx(3e-6, rel=1e-3)
    fit = StepFit()
    for n in (1, 2048) * (MIN_STEPS // 2 - 1):
        fit.observe(n, 1e-3 + n * 1e-6)
    assert fit.slope is None            # fewer steps than MIN_STEPS


def test_a_noisy_fit_is_close():
    fit, rng = StepFit(), random.Random(3)
    for _ in range(2000):
        n = rng.randrange(1, 2049)
        fit.observe(n, (0.004 + 2e-6 * n) * rng.uniform(0.9, 1.1))
    assert fit.slope == pytest.approx(2e-6, rel=0.2)


def _rule(load_s_per_block, recompute_s_per_token, bs=4, policy="auto"):
    rule = TierCost(policy, load_s_per_block, bs)
    rule.fit.slope = recompute_s_per_token
    return rule


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
    assert _rule(1.0, None).cut(hits) == 5        # no step times fitted yet: loads
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


def _result(device_ms=0.0, execute_ms=0.0):
    return types.SimpleNamespace(device_ms=device_ms, execute_ms=execute_ms)


def test_step_results_feed_the_fit_and_swap_in_steps_do_not():
    rule = TierCost("auto", 1e-6, 4)
    sched = _sched(blocks=64, host=8, cost=rule)
    for n in [1, 64, 8, 32] * 4:
        step = ScheduledStep()
        step.running.num_tokens.append(n)
        rule.observe(step, _result(device_ms=2.0 + n * 0.01, execute_ms=99.0), on_device=True)
    assert rule.recompute_s_per_token == pytest.approx(1e-5)
    waited = ScheduledStep(swap_in=[(0, 0)])
    waited.running.num_tokens.append(1)
    rule.observe(waited, _result(device_ms=500.0), on_device=True)
    assert rule.recompute_s_per_token == pytest.approx(1e-5)
    assert rule.loads() is True and isinstance(sched, Scheduler)
    cpu = TierCost("auto", 1.0, 4)
    for n in [1, 64, 8, 32] * 4:
        step = ScheduledStep()
        step.running.num_tokens.append(n)
        cpu.observe(step, _result(execute_ms=1.0 + n * 0.1), on_device=False)
    assert cpu.recompute_s_per_token == pytest.approx(1e-4) and cpu.loads() is False


def test_the_rule_is_logged_at_start_and_when_autos_verdict_changes(caplog):
    from controlplane import host_tier
    from controlplane.block_manager import BlockManager

    rule = TierCost("auto", 4.2e-6 * 16, 16)
    with caplog.at_level("INFO", logger="headrace.engine"):
        host_tier.report(BlockManager(8, 16, True, host_blocks=4), "recompute", rule)
        for n in [1, 64, 8, 32] * 4:   # 1 us per token: recompute is cheaper
            step = ScheduledStep()
            step.running.num_tokens.append(n)
            rule.observe(step, _result(device_ms=1.0 + n * 1e-3), on_device=True)
        for n in [1, 64, 8, 32] * 40:  # 10 us per token: loading is
            step = ScheduledStep()
            step.running.num_tokens.append(n)
            rule.observe(step, _result(device_ms=1.0 + n * 1e-2), on_device=True)
    lines = [r.getMessage() for r in caplog.records]
    assert "offloading policy auto, host load 4.20 us/token" in lines[0]
    verdicts = [line for line in lines if "host hits are" in line]
    assert len(verdicts) == 2 and "recomputed" in verdicts[0] and "loaded" in verdicts[1]
    assert "load 4.20 us/token, recompute 1.00 us/token" in verdicts[0]   # logged when it flips
    assert rule.recompute_s_per_token == pytest.approx(1e-5, rel=0.05)   # the old regime fades
