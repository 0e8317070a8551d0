"""Placement over data-parallel engine cores (headrace.controlplane.frontend.placement): the prefix
holder wins unless its prefix is too short or it is much busier than the least loaded core; equal
cores share the work; only ready cores are chosen (hypothesis: the invariants over random loads and
caches)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.frontend.placement import Placement, load_score


@dataclasses.dataclass
class Core:
    load: int = 0
    cached: tuple[int, ...] = ()
    ready: bool = True

    def match(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n


PROMPT = [1, 2, 3, 4]


def test_the_core_holding_the_prefix_wins_while_not_much_busier():
    cores = [Core(load=5), Core(load=20, cached=(1, 2, 3)), Core(load=9, cached=(1, 2))]
    choice = Placement().choose(cores, PROMPT)
    assert (choice.index, choice.reason, choice.matched) == (1, "prefix", 3)
    cores[1].load = 38                       # 33 more than the least loaded and > 1.5x: too busy
    assert Placement().choose(cores, PROMPT).index == 0
    assert Placement().choose(cores, PROMPT).reason == "balance"
    cores[1].load = 37                       # 32 more: not "more than 32"
    assert Placement().choose(cores, PROMPT).index == 1
    cores[0].load, cores[1].load, cores[2].load = 100, 140, 120   # 40 more but 1.4x: the holder
    assert Placement().choose(cores, PROMPT).index == 1


def test_equal_prefixes_go_to_the_least_loaded_holder():
    cores = [Core(load=7, cached=(1, 2, 3)), Core(load=3, cached=(1, 2, 3)), Core(load=0)]
    assert Placement().choose(cores, PROMPT).index == 1


def test_a_short_shared_prefix_does_not_outweigh_the_load():
    cores = [Core(load=4, cached=(1,)), Core(load=0)]     # 1 of 4 blocks: below the 0.5 threshold
    choice = Placement().choose(cores, PROMPT)
    assert (choice.index, choice.reason) == (1, "load")
    assert Placement(cache_threshold=0.25).choose(cores, PROMPT).index == 0


def test_without_a_prefix_equal_cores_take_turns():
    placement, cores = Placement(), [Core(), Core(), Core()]
    assert [placement.choose(cores, PROMPT).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [placement.choose(cores, []).index for _ in range(3)] == [0, 1, 2]


def test_round_robin_and_least_load_ignore_the_cache():
    cores = [Core(load=9, cached=(1, 2, 3, 4)), Core(load=1), Core(load=5, ready=False)]
    rr = Placement("round-robin")
    assert [rr.choose(cores, PROMPT).index for _ in range(4)] == [0, 1, 0, 1]
    assert Placement("least-load").choose(cores, PROMPT).index == 1


def test_only_ready_cores_are_chosen():
    cores = [Core(cached=(1, 2, 3, 4), ready=False), Core(load=50)]
    assert Placement().choose(cores, PROMPT).index == 1
    cores[1].ready = False
    assert Placement().choose(cores, PROMPT) is None and Placement().choose([], PROMPT) is None


def test_bad_settings_are_refused():
    for kwargs in ({"policy": "random"}, {"balance_abs": -1}, {"balance_rel": 0.5},
                   {"cache_threshold": 2}):
        with pytest.raises(ValueError):
            Placement(**kwargs)


def test_waiting_weighs_more_than_running():
    assert load_score(running=8, waiting=0) < load_score(running=0, waiting=3)


cores_st = st.lists(st.builds(Core, load=st.integers(0, 200),
                              cached=st.lists(st.integers(1, 6), max_size=6).map(tuple),
                              ready=st.booleans()), max_size=6)


@settings(max_examples=300, deadline=None)
@given(cores=cores_st, prompt=st.lists(st.integers(1, 6), max_size=6),
       policy=st.sampled_from(["prefix", "least-load", "round-robin"]))
def test_a_choice_is_a_ready_core_and_never_a_much_busier_one(cores, prompt, policy):
    placement = Placement(policy)
    choice = placement.choose(cores, prompt)
    ready = [c for c in cores if c.ready]
    if not ready:
        assert choice is None
        return
    chosen = cores[choice.index]
    assert chosen.ready and choice.matched == chosen.match(prompt)
    least = min(c.load for c in ready)
    if policy == "least-load":
        assert chosen.load == least
    if policy == "prefix":
        assert not placement.much_busier(chosen.load, least)
        if choice.reason == "prefix":
            assert choice.matched == max(c.match(prompt) for c in ready) > 0
        else:
            assert chosen.load == least
