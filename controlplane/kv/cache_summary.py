"""What an engine core's prefix cache holds, as the API front ends see it (data parallelism,
``--data-parallel-size``): the core records its caches' changes (``CacheEvents``, attached to
its block manager with ``BlockManager.watch``) and sends them on every placing front end's
stream (``headrace.core.v1.CoreLoad``: chained block hashes, as changes, or the whole cache
after a reset); each front end keeps one ``CacheView`` per core and matches a prompt's hashes
(``prompt_hashes``: the block manager's own ``chain_hash``, so no token id leaves the front
end) against it.

The summary is bounded by the core's cache (one 8-byte hash per cached block and tier), and
costs the core one list append per block entering or leaving a cache. Beside what the core
confirmed, a view holds what its front end placed there moments ago (``expect``: a prompt's
hashes until the core confirms them or ``ttl_s`` passes), so a burst of requests sharing a new
prefix follows the first one before its blocks are even computed (SGLang's router inserts a
routed prompt into its tree the same way).
"""

from __future__ import annotations

import time

from headrace.controlplane.kv.block_manager import _ROOT_HASH, chain_hash

EXPECT_TTL_S = 5.0        # an expected block not confirmed by then is forgotten
MAX_EXPECTED = 1 << 16    # expected hashes kept per core at most (oldest dropped)


def prompt_hashes(token_ids, block_size: int, root: int = _ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks ``BlockManager.match_prefix`` could find for
    ``token_ids`` (every full block before the last token); ``root``: a LoRA adapter's."""
    h, out = root, []
    for i in range((len(token_ids) - 1) // block_size):
        h = chain_hash(h, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(h)
    return out


class CacheEvents:
    """Changes of a block manager's prefix caches (device and host tier) since ``take``; each
    entry is one tier's hash coming or going, so a hash both tiers hold comes twice."""

    def __init__(self):
        self.stored: list[int] = []
        self.evicted: list[int] = []
        self.reset = True   # the consumer starts from a snapshot (``BlockManager.hashes``)

    def take(self) -> tuple[bool, list[int], list[int]]:
        out = self.reset, self.stored, self.evicted
        self.reset, self.stored, self.evicted = False, [], []
        return out

    def clear(self) -> None:
        """The caches were emptied: the next ``take`` is a reset."""
        self.reset, self.stored, self.evicted = True, [], []

    @property
    def pending(self) -> bool:
        return self.reset or bool(self.stored) or bool(self.evicted)


class CacheView:
    """A front end's copy of one core's caches (a count per hash: one per tier holding it)
    plus the hashes it expects there."""

    def __init__(self, ttl_s: float = EXPECT_TTL_S, max_expected: int = MAX_EXPECTED,
                 clock=time.monotonic):
        self.counts: dict[int, int] = {}
        self.expected: dict[int, float] = {}   # hash -> expiry, oldest first
        self.ttl_s, self.max_expected, self.clock = ttl_s, max_expected, clock

    def __len__(self) -> int:
        return len(self.counts)

    def apply(self, reset: bool, stored, evicted) -> None:
        """One ``CoreLoad``'s cache part (``reset``: ``stored`` is the whole cache)."""
        counts, expected = self.counts, self.expected
        if reset:
            counts.clear()
        for h in stored:
            counts[h] = counts.get(h, 0) + 1
            expected.pop(h, None)
        for h in evicted:
            left = counts.get(h, 0) - 1
            if left > 0:
                counts[h] = left
            else:
                counts.pop(h, None)
                expected.pop(h, None)

    def expect(self, hashes: list[int]) -> None:
        """A prompt with ``hashes`` was just placed on this core."""
        expected, until = self.expected, self.clock() + self.ttl_s
        for h in hashes:
            if h not in self.counts:
                expected.pop(h, None)
                expected[h] = until
        while len(expected) > self.max_expected:
            del expected[next(iter(expected))]

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt this core holds or is expected to hold."""
        counts, expected, now, n = self.counts, self.expected, self.clock(), 0
        for h in hashes:
            if h not in counts:
                until = expected.get(h)
                if until is None or until < now:
                    break
            n += 1
        return n

    def clear(self) -> None:
        """The core is gone (its caches with it)."""
        self.counts.clear()
        self.expected.clear()
