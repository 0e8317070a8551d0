"""Block manager invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.block_manager import BlockManager


def _check(bm: BlockManager, lengths: dict[int, int]) -> None:
    owned = [b for table in bm.tables.values() for b in table]
    free = list(bm._free)
    assert len(owned) == len(set(owned)), "a block owned twice"
    assert not set(owned) & set(free), "a block both free and owned"
    assert sorted(owned + free) == list(range(bm.num_blocks)), "a block lost"
    for seq, n in lengths.items():
        assert len(bm.tables.get(seq, [])) == bm.blocks_for(n)


ops = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_random_grow_and_free_keep_the_pool_consistent(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    lengths: dict[int, int] = {}
    for op, seq, n in ops:
        if op == "grow":
            target = lengths.get(seq, 0) + n
            if bm.can_grow(seq, target):
                before = len(bm.tables.get(seq, []))
                new = bm.grow(seq, target)
                assert bm.tables[seq][before:] == new
                lengths[seq] = target
            else:
                with pytest.raises(MemoryError):
                    bm.grow(seq, target)
        else:
            bm.free(seq)
            lengths.pop(seq, None)
        _check(bm, lengths)
    for seq in list(lengths):
        bm.free(seq)
    assert bm.num_free == num_blocks


def test_grow_returns_only_new_blocks():
    bm = BlockManager(8, 4)
    assert len(bm.grow(1, 5)) == 2
    assert bm.grow(1, 8) == []
    assert len(bm.grow(1, 9)) == 1
    assert bm.num_free == 5 and bm.usage == pytest.approx(3 / 8)
