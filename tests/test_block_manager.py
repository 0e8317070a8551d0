"""Block manager: the pool's accounting invariants under random grow / register / adopt /
fork / free sequences (hypothesis), and the queries the scheduler asks of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.block_manager import BlockManager


def _check(bm: BlockManager, covered: dict[int, int]) -> None:
    """``covered``: tokens each live sequence's table must cover (the test's own record)."""
    owners: dict[int, int] = {}
    for seq in covered:
        for b in bm.block_ids(seq):
            owners[b] = owners.get(b, 0) + 1
    free = list(bm._free)
    assert len(free) == len(set(free)) == bm.num_free
    assert all(bm.ref[b] == owners.get(b, 0) for b in range(bm.num_blocks)), "a reference count is off"
    assert set(free) == {b for b in range(bm.num_blocks) if bm.ref[b] == 0}, "free and owned overlap"
    assert bm.usage == pytest.approx(1 - len(free) / bm.num_blocks)
    bs = bm.block_size
    for seq, n in covered.items():
        table = bm.block_ids(seq)
        assert len(table) == bm.blocks_for(n)
        assert len(set(table)) == len(table), "a table holds a block twice"
        assert bm.num_slots(seq) == len(table) * bs
        assert not bm.needs_blocks(seq, n) and bm.needs_blocks(seq, bm.num_slots(seq) + 1)
        assert bm.max_tokens_growable(seq) == (len(table) + bm.num_free) * bs
        assert bm.can_grow(seq, bm.max_tokens_growable(seq))
        assert not bm.can_grow(seq, bm.max_tokens_growable(seq) + 1)


BASES = ([1, 2, 3, 4, 5, 6, 7, 8] * 8, [9, 8, 7, 6] * 16)   # token streams that share prefixes
ops = st.lists(st.tuples(st.sampled_from(["grow", "register", "adopt", "fork", "free"]),
                         st.integers(0, 5), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=ops,
       prefix=st.booleans())
def test_random_operations_keep_the_pool_consistent(num_blocks, block_size, ops, prefix):
    bm = BlockManager(num_blocks, block_size, prefix)
    covered: dict[int, int] = {}
    tokens = {seq: BASES[seq % 2][:40 + seq] for seq in range(6)}
    for op, seq, other, n in ops:
        if op == "grow":
            target = covered.get(seq, 0) + n
            if bm.can_grow(seq, target):
                before, need = bm.block_ids(seq), bm.blocks_needed(seq, target)
                new = bm.grow(seq, target)
                assert bm.block_ids(seq) == before + tuple(new) and len(new) == need, "grow appends"
                covered[seq] = target
            else:
                with pytest.raises(MemoryError):
                    bm.grow(seq, target)
        elif op == "register" and seq in covered:
            bm.register(seq, lambda s=seq: tokens[s], min(covered[seq], len(tokens[seq])))
        elif op == "adopt" and seq not in covered:
            hits = bm.match_prefix(tokens[seq])
            cached = bm.cached_tokens(hits)
            assert cached <= len(tokens[seq]) - 1, "the last token is always computed"
            end = min(cached + n, len(tokens[seq]))
            cost = bm.cost(hits, end)
            if cost <= bm.num_free:
                free_before = bm.num_free
                bm.adopt(seq, hits, len(tokens[seq]))
                bm.grow(seq, end)
                assert bm.block_ids(seq)[:len(hits)] == tuple(hits)
                assert free_before - bm.num_free == cost, "adopting took what cost() said"
                covered[seq] = end
        elif op == "fork" and seq in covered and other not in covered and bm.num_free >= 1:
            position = n % covered[seq]
            (src, dst), shared_tokens = bm.fork(seq, other, position)
            k = position // block_size
            parent, child = bm.block_ids(seq), bm.block_ids(other)
            assert shared_tokens == k * block_size and child[:k] == parent[:k]
            assert (src, dst) == (parent[k], child[k]) and len(child) == k + 1 and dst not in parent
            covered[other] = position + 1
        elif op == "free":
            bm.free(seq)
            covered.pop(seq, None)
            assert bm.block_ids(seq) == () and bm.num_slots(seq) == 0
        _check(bm, covered)
    for seq in list(covered):
        bm.free(seq)
    assert bm.num_free == num_blocks and not any(bm.ref)


def test_grow_returns_only_new_blocks():
    bm = BlockManager(8, 4)
    assert len(bm.grow(1, 5)) == 2
    assert bm.grow(1, 8) == []
    assert len(bm.grow(1, 9)) == 1
    assert bm.num_free == 5 and bm.usage == pytest.approx(3 / 8)


def test_table_queries():
    bm = BlockManager(8, 4)
    assert bm.block_ids(1) == () and bm.num_slots(1) == 0 and bm.needs_blocks(1, 1)
    assert not bm.needs_blocks(1, 0)
    bm.grow(1, 5)
    assert bm.num_slots(1) == 8 and not bm.needs_blocks(1, 8) and bm.needs_blocks(1, 9)
    assert bm.max_tokens_growable(1) == 8 * 4
    table = bm.block_ids(1)
    bm.grow(1, 9)
    assert len(table) == 2, "block_ids is a snapshot, not the live table"


def test_fork_shares_full_blocks_and_copies_the_one_it_writes():
    bm = BlockManager(8, 4)
    bm.grow(1, 10)                          # blocks for tokens 0-3, 4-7, 8-9
    (src, dst), shared = bm.fork(1, 2, 9)   # the child recomputes token 9
    parent, child = bm.block_ids(1), bm.block_ids(2)
    assert shared == 8 and child[:2] == parent[:2] and (src, dst) == (parent[2], child[2])
    assert [bm.ref[b] for b in parent] == [2, 2, 1] and bm.num_free == 4
    (src, dst), shared = bm.fork(1, 3, 8)   # a block boundary: nothing of block 2 is shared
    assert shared == 8 and src == parent[2]
    bm.free(1)
    assert [bm.ref[b] for b in child] == [2, 2, 1]   # children 2 and 3 share blocks 0-1


def test_reset_cache_forgets_every_prefix():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    bm.grow(1, 10)
    bm.register(1, lambda: prompt, 10)
    assert bm.match_prefix(prompt) == list(bm.block_ids(1)[:2])
    bm.reset_cache()
    assert bm.match_prefix(prompt) == []
