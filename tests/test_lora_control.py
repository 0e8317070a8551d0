"""The control plane's LoRA decisions without a data plane: device slots and host caches least
recently used first, a slot in use never taken (a property test over random traffic), the
``--lora-modules`` syntax, prefix-cache chains rooted per adapter (two adapters never share
KV, in either tier), and the step protocol's fields."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings, strategies as st

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.kv.cache_summary import prompt_hashes
from headrace.controlplane.lora.registry import parse_modules
from headrace.controlplane.lora.slots import Adapter, Slots
from headrace.controlplane.scheduling.step import NewSeq, ScheduledStep
from headrace.controlplane.engine import step_codec


def _adapter(i: int, cached: bool = True) -> Adapter:
    return Adapter(f"a{i}", f"/p/{i}", i, cached=cached, root=1000 + i, cache_id=100 + i)


def _running(*adapters):
    return [types.SimpleNamespace(lora=a) for a in adapters]


def test_slots_fill_then_take_the_least_recently_used_free_one():
    slots = Slots(2, 3)
    a, b, c = _adapter(1), _adapter(2), _adapter(3)
    assert slots.acquire(a, []) and slots.acquire(b, [])
    assert slots.take_ops() == ([(0, 101), (1, 102)], [])   # (slot, the copy's cache id)
    slots.begin_step()
    assert slots.acquire(a, [])                     # already in slot 0: touched, no load
    assert not slots.pending
    slots.begin_step()
    assert slots.acquire(c, [])                     # b is the least recently used
    assert (c.slot, b.slot, a.slot) == (1, None, 0) and slots.take_ops() == ([(1, 103)], [])


def test_a_slot_in_use_or_claimed_in_the_step_is_never_taken_and_uncached_adapters_wait():
    slots = Slots(1, 2)
    a, b = _adapter(1), _adapter(2)
    assert slots.acquire(a, [])
    assert not slots.acquire(b, [])                 # a was given the slot in this step
    slots.begin_step()
    assert not slots.acquire(b, _running(a))        # a runs: b waits for the slot
    assert a.slot == 0 and b.slot is None
    slots.begin_step()
    assert slots.acquire(b, _running(None))         # a finished
    assert not slots.acquire(_adapter(3, cached=False), [])   # not read into the host caches yet


def test_host_cache_drops_the_least_recently_used_outside_a_slot_first():
    slots = Slots(1, 2)
    a, b, c = _adapter(1, False), _adapter(2, False), _adapter(3, False)
    for x in (a, b):
        x.touch()
        assert slots.make_room(x) == []
        slots.cached(x)
    slots.acquire(a, [])                            # a in the slot, b not: b goes first
    assert slots.make_room(c) == [b] and not b.cached and a.cached
    assert slots.make_room(c, reserved=1) == [a]    # another read in flight needs its place
    assert slots.take_ops() == ([(0, 101)], [102, 101])   # drops after the loads of the step
    slots.forget(a)
    assert a.slot is None and not slots.pending     # (its host copy was dropped already)
    slots.reset()
    assert a.slot is None and not a.cached and slots.cache == {} and not slots.pending


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=60),
       st.integers(1, 3))
def test_slot_invariants_under_random_traffic(events, num_slots):
    """Whatever arrives and finishes: every running adapter keeps its slot, slots hold distinct
    adapters, and an adapter's slot field agrees with the table."""
    slots = Slots(num_slots, 6)
    adapters = [_adapter(i) for i in range(6)]
    running: list = []
    for index, finish in events:
        adapter = adapters[index]
        if finish:
            running = [s for s in running if s.lora is not adapter]
            continue
        held = {s.lora.id: s.lora.slot for s in running}
        slots.begin_step()
        if slots.acquire(adapter, running):
            running.append(types.SimpleNamespace(lora=adapter))
        assert all(s.lora.slot == held[s.lora.id] for s in running if s.lora.id in held)
        in_slots = [a for a in slots.held if a is not None]
        assert len({a.id for a in in_slots}) == len(in_slots)
        for i, a in enumerate(slots.held):
            assert a is None or a.slot == i
        assert all(s.lora.slot is not None for s in running)


def test_lora_modules_syntax():
    assert parse_modules(["a=/x", ' {"name": "b", "path": "/y"} ']) == [("a", "/x"), ("b", "/y")]
    for bad, message in ((["a"], "name=path"), (["=x"], "a name"), (["a=/x", "a=/y"], "twice"),
                         (['{"name": "a"}'], "name=path or")):
        with pytest.raises(ValueError, match=message):
            parse_modules(bad)


def test_prefix_chains_are_rooted_per_adapter_in_both_tiers():
    blocks = BlockManager(4, 2, host_blocks=4)
    prompt = [1, 2, 3, 4, 5]
    blocks.adopt(1, [], 5)
    blocks.grow(1, 5)
    blocks.register(1, lambda: prompt, 4, root=77)   # two full blocks under adapter root 77
    assert len(blocks.match_prefix(prompt, 77)) == 2
    assert blocks.match_prefix(prompt) == [] and blocks.match_prefix(prompt, 78) == []
    assert prompt_hashes(prompt, 2, 77) == [blocks._hash[b] for b in blocks.block_ids(1)[:2]]
    blocks.free(1)
    for i in range(2, 6):   # new sequences evict the cached blocks to the host tier
        blocks.adopt(i, [], 2)
        blocks.grow(i, 2)
    hits = blocks.match_prefix(prompt, 77)
    assert len(hits) == 2 and all(b < 0 for b in hits)   # found in the host tier, same root
    assert blocks.match_prefix(prompt) == []


def test_step_codec_sends_slots_one_based_and_the_loads():
    from headrace.controlplane.requests.output import OutputText  # noqa: F401 (Sequence's field type)
    from headrace.controlplane.requests.request import Request, Sequence
    from headrace.worker.v1 import worker_pb2 as wpb

    adapter = _adapter(9)
    adapter.slot = 2
    req = Request("r")
    seqs = [Sequence(req, 1, 0, [1, 2], wpb.Sampling(), 4, None),
            Sequence(req, 2, 1, [1, 2], wpb.Sampling(), 4, None, lora=adapter)]
    step = ScheduledStep(new=[NewSeq(s, 2, (0,)) for s in seqs], lora_loads=[(2, 9)])
    msg = step_codec.encode(step, 5, flush=True)
    assert [n.lora_slot for n in msg.new_seqs] == [0, 3]
    assert [(l.slot, l.adapter_id) for l in msg.lora_loads] == [(3, 9)]
    assert seqs[1].cache_root == 1009 and seqs[0].cache_root == 0
