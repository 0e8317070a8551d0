"""The front end's copy of an engine core's prefix cache (headrace.controlplane.kv.cache_summary):
fed the block manager's recorded changes, it holds exactly the hashes both tiers cache, under random
grow / register / adopt / free / reset sequences with evictions (hypothesis); a prompt's hashes are
the ones the block manager finds; expected hashes hold for their time only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.kv.cache_summary import CacheEvents, CacheView, prompt_hashes

STREAMS = ([1, 2, 3, 4, 5, 6, 7, 8] * 8, [9, 8, 7, 6] * 16, [5, 5, 1, 2] * 16)


def _summary(bm: BlockManager) -> dict[int, int]:
    counts: dict[int, int] = {}
    for h in bm.hashes():
        counts[h] = counts.get(h, 0) + 1
    return counts


# "run": a whole request (adopt its prefix hits, compute the rest, publish its blocks, finish)
ops = st.lists(st.tuples(st.sampled_from(["run", "run", "adopt", "register", "free", "reset"]),
                         st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 16), host_blocks=st.sampled_from([0, 3, 8]),
       block_size=st.sampled_from([2, 4]), ops=ops)
def test_the_view_holds_exactly_what_both_tiers_cache(num_blocks, host_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size, host_blocks=host_blocks)
    events, view, covered = CacheEvents(), CacheView(), {}
    bm.watch(events)

    def publish():
        reset, stored, evicted = events.take()
        view.apply(reset, bm.hashes() if reset else stored, [] if reset else evicted)

    tokens = {seq: STREAMS[seq % 3][:24 + seq] for seq in range(6)}
    for op, seq, n in ops:
        if op in ("adopt", "run") and seq not in covered:
            hits = bm.match_prefix(tokens[seq])
            end = len(tokens[seq]) if op == "run" else min(bm.cached_tokens(hits) + n, len(tokens[seq]))
            if bm.cost(hits, end) <= bm.num_free:
                bm.adopt(seq, hits, len(tokens[seq]))
                bm.grow(seq, end)
                covered[seq] = end
                if op == "run":
                    bm.register(seq, lambda s=seq: tokens[s], end)
                    bm.free(seq)
                    del covered[seq]
            bm.take_ops()
        elif op == "register" and seq in covered:
            bm.register(seq, lambda s=seq: tokens[s], covered[seq])
        elif op == "free" and seq in covered:
            bm.free(seq)
            del covered[seq]
        elif op == "reset":
            bm.reset_cache()
        publish()   # (the core sends them every few ms: changes, not the cache, but after a reset)
        assert view.counts == _summary(bm)
    for seq, toks in tokens.items():   # the view finds what the block manager would
        assert view.match(prompt_hashes(toks, block_size)) >= len(bm.match_prefix(toks))


def test_prompt_hashes_are_the_block_managers_hashes():
    bm = BlockManager(8, 4)
    ids = list(range(1, 14))                 # 13 tokens: 3 full blocks before the last token
    bm.adopt(1, [], len(ids))
    bm.grow(1, len(ids))
    bm.register(1, lambda: ids, len(ids))
    assert prompt_hashes(ids, 4) == list(bm.cached)[:3]
    assert len(prompt_hashes(ids[:12], 4)) == 2   # the last token's block is never a hit
    assert prompt_hashes([1, 2, 3], 4) == []


def test_expected_hashes_count_until_they_expire_and_evictions_drop_them():
    now = [0.0]
    view = CacheView(ttl_s=2.0, clock=lambda: now[0])
    view.expect([11, 12, 13])
    assert view.match([11, 12, 13, 14]) == 3 and view.match([12]) == 1 and view.match([99, 11]) == 0
    view.apply(False, [11], [])
    now[0] = 3.0                             # 12, 13 were never confirmed: gone
    assert view.match([11, 12, 13]) == 1
    view.expect([12])
    view.apply(False, [], [12])              # evicted before computed? no longer expected either
    assert view.match([11, 12]) == 1
    view.apply(True, [], [])                 # a reset forgets the confirmed ones
    assert view.match([11]) == 0 and len(view) == 0


def test_expected_hashes_are_bounded():
    view = CacheView(max_expected=4)
    view.expect(list(range(10)))
    assert list(view.expected) == [6, 7, 8, 9]
