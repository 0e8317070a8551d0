"""Paged KV block manager with automatic prefix caching.

Owns the pool of fixed-size blocks, every sequence's block table and the blocks' reference
counts. A full block is identified by a chained hash of (previous block's hash, its token
ids) and verified by comparing tokens; it is registered as soon as the step that writes it is
scheduled, so a request admitted later, even in the same step, shares it instead of
computing it again. Unreferenced blocks sit in an LRU free queue: cached ones stay reusable
until a new allocation evicts them (blocks that hold nothing reusable are taken first).
The control plane owns every block decision; workers only mirror the tables it sends.

With a host tier (``headrace.controlplane.kv.host_tier``) an evicted cached block is offloaded there
and a prefix hit may be found there: such a hit is given as ``~host_block`` (negative) in the hits
list and is copied into a fresh device block when adopted.

Watched (``watch``: an engine core whose front ends place requests over several cores,
``headrace.controlplane.kv.cache_summary``), every hash entering or leaving either tier's cache is
recorded, so the front ends can keep a copy of what each core caches.
"""

from __future__ import annotations

import collections
import struct
from typing import Callable

import xxhash

from headrace.controlplane.kv.host_tier import HostTier

_ROOT_HASH = 0


def chain_hash(previous: int, tokens: tuple[int, ...]) -> int:
    """xxh64 of the previous block's hash and the block's token ids (little-endian u32s),
    packed in one C call: a prefill step registers hundreds of blocks."""
    return xxhash.xxh64_intdigest(struct.pack(f"<Q{len(tokens)}I", previous, *tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 host_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}                 # chain hash -> block id
        self._tables: dict[int, list[int]] = {}          # seq id -> block ids
        self._chain: dict[int, list[int]] = {}           # seq id -> hashes of its leading full blocks
        self.prefix_queries = 0                          # tokens looked up / found (metrics)
        self.prefix_hits = 0
        self.host = HostTier(host_blocks) if host_blocks > 0 else None
        self.offload_evicted = True   # False: evicted blocks are dropped (the tier only swaps)
        self.events = None   # a cache_summary.CacheEvents, when watched

    def watch(self, events) -> None:
        """Records the caches' changes in ``events`` (``stored``/``evicted`` lists of hashes,
        ``clear()`` on a reset) from now on."""
        self.events = events
        if self.host is not None:
            self.host.events = events

    def hashes(self) -> list[int]:
        """Every hash the caches hold, once per tier holding it."""
        host = list(self.host.cached) if self.host is not None else []
        return list(self.cached) + host

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's block table (empty when it holds no blocks)."""
        return tuple(self._tables.get(seq_id, ()))

    def num_slots(self, seq_id: int) -> int:
        """Tokens the sequence's blocks can hold."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def needs_blocks(self, seq_id: int, num_tokens: int) -> bool:
        """Whether covering ``num_tokens`` tokens takes new blocks (a decode mostly does not);
        runs per sequence and step, so it is kept to one lookup."""
        table = self._tables.get(seq_id)
        return num_tokens > (len(table) * self.block_size if table else 0)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks a sequence needs so that its table covers ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_grow(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq_id, num_tokens) + reserve <= len(self._free)

    def max_tokens_growable(self, seq_id: int) -> int:
        """Tokens the sequence's table could cover if it took every free block."""
        return (len(self._tables.get(seq_id, ())) + len(self._free)) * self.block_size

    def match_prefix(self, token_ids: list[int], root: int = _ROOT_HASH) -> list[int]:
        """Cached blocks holding the longest prefix of ``token_ids``, leaving at least the last
        token to compute (its logits are needed). ``root``: the hash chain's start (a LoRA
        adapter's: its KV is never another model's)."""
        if not self.enable_prefix_cache:
            return []
        bs, h, hits, host = self.block_size, root, [], self.host
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(h, tokens)
            block = self.cached.get(h)
            if block is None or self._tokens[block] != tokens:
                block = host.lookup(h, tokens) if host is not None else None
                if block is None:
                    break
                block = ~block   # on the host: copied back when adopted
            hits.append(block)
        return hits

    def cached_tokens(self, hits: list[int]) -> int:
        """Tokens that the prefix hits ``hits`` hold."""
        return len(hits) * self.block_size

    def cost(self, hits: list[int], num_tokens: int) -> int:
        """Free-pool blocks that adopting ``hits`` and covering ``num_tokens`` would take."""
        return sum(1 for b in hits if b < 0 or self.ref[b] == 0) + max(0, self.blocks_for(num_tokens) - len(hits))

    # -- changes -------------------------------------------------------------------------
    def adopt(self, seq_id: int, hits: list[int], num_tokens: int) -> None:
        """Starts a sequence's table with cached blocks (shared: reference counted); counts
        the admission's ``num_tokens`` as prefix-cache queries and the hits' tokens as hits."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        for b in hits:
            if b >= 0:
                if self.ref[b] == 0:
                    del self._free[b]
                self.ref[b] += 1
            else:   # pinned before any _take below can evict to the host tier
                self.host.hold(~b)
        table = list(hits)
        for i, b in enumerate(hits):
            if b < 0:
                h, tokens = self.host.entry(~b)
                table[i] = d = self._take()
                self.host.fetch(~b, d, self.block_size)
                self._hash[d], self._tokens[d] = h, tokens
                self.cached[h] = d
                if self.events is not None:
                    self.events.stored.append(h)
        self._tables[seq_id] = table
        self._chain[seq_id] = [self._hash[b] for b in table]
        if self.enable_prefix_cache:
            self.prefix_queries += num_tokens
            self.prefix_hits += len(hits) * self.block_size

    def share(self, parent: int, child: int, num_blocks: int) -> None:
        """Gives ``child`` the first ``num_blocks`` blocks of ``parent`` (parallel sampling)."""
        assert child not in self._tables, f"sequence {child} already has blocks"
        shared = self._tables[parent][:num_blocks]
        for b in shared:
            self.ref[b] += 1
        self._tables[child] = list(shared)
        self._chain[child] = self._chain.get(parent, [])[:num_blocks]

    def fork(self, parent: int, child: int, position: int) -> tuple[tuple[int, int], int]:
        """Copy on write for a parallel sample that recomputes token ``position`` of its
        parent's: ``child`` shares the parent's blocks before the one holding that token and
        gets a fresh block for it (needs one free block). Returns the (parent's block, child's
        block) pair for the workers to copy and the tokens the shared blocks hold."""
        shared = position // self.block_size
        self.share(parent, child, shared)
        (dst,) = self.grow(child, position + 1)
        return (self._tables[parent][shared], dst), shared * self.block_size

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:   # evict it from the prefix cache (to the host tier, if any)
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.evicted.append(h)
                if self.host is not None and self.offload_evicted:
                    self.host.offload(block, h, self._tokens[block])
            self._hash[block] = self._tokens[block] = None
        self.ref[block] = 1
        return block

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Appends blocks so the table covers ``num_tokens``; returns the new block ids."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {need} blocks, {len(self._free)} free")
        new = [self._take() for _ in range(need)]
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def register(self, seq_id: int, token_ids: Callable[[], list[int]], num_tokens: int,
                 root: int = _ROOT_HASH) -> None:
        """Publishes the sequence's blocks that ``num_tokens`` tokens fill completely.
        ``token_ids`` is called only when a block boundary was crossed; ``root``: the chain's
        start (as ``match_prefix``'s)."""
        chain, table, bs = self._chain.setdefault(seq_id, []), self._tables[seq_id], self.block_size
        if not self.enable_prefix_cache or num_tokens // bs <= len(chain):
            return
        token_ids = token_ids()
        for i in range(len(chain), num_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(chain[-1] if chain else root, tokens)
            chain.append(h)
            block = table[i]
            if h not in self.cached and self._hash[block] is None:
                self._hash[block], self._tokens[block] = h, tokens
                self.cached[h] = block
                if self.events is not None:
                    self.events.stored.append(h)

    def truncate(self, seq_id: int, num_tokens: int) -> int | None:
        """Gives back the blocks of the table beyond what ``num_tokens`` tokens need (the
        rejected positions of a speculative step: never registered, so never shared); returns
        the table's new length when it shrank, else None."""
        table, keep = self._tables.get(seq_id), self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return None
        self._unref(table[keep:])
        del table[keep:]
        return keep

    def free(self, seq_id: int) -> None:
        """Drops a sequence's references. Its blocks stay cached; tail blocks, and blocks that
        hold nothing reusable, are evicted first."""
        self._chain.pop(seq_id, None)
        self._unref(self._tables.pop(seq_id, ()))

    def _unref(self, blocks) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)

    def reset_cache(self) -> None:
        """Forgets every cached block (the workers' KV contents are no longer trusted), on
        both tiers, with the swapped sequences' host blocks and every pending copy."""
        for b in range(self.num_blocks):
            self._hash[b] = self._tokens[b] = None
        self.cached.clear()
        if self.host is not None:
            self.host.reset()
        if self.events is not None:
            self.events.clear()

    # -- the host tier ---------------------------------------------------------------------
    def swap_out(self, seq_id: int, num_tokens: int) -> bool:
        """Swap preemption: copies the blocks holding the sequence's first ``num_tokens``
        tokens to the host tier (the caller frees its table next); False when it cannot."""
        table = self._tables.get(seq_id, ())
        n = self.blocks_for(num_tokens)
        if self.host is None or n == 0 or n > len(table):
            return False
        return self.host.swap_out_seq(seq_id, table[:n])

    def is_swapped(self, seq_id: int) -> bool:
        return self.host is not None and seq_id in self.host.swapped

    def swap_in_cost(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks resuming a swapped sequence with a table for ``num_tokens`` takes."""
        return max(self.blocks_for(num_tokens), len(self.host.swapped[seq_id]))

    def swap_in(self, seq_id: int, num_tokens: int) -> None:
        """Resumes a swapped sequence: fresh device blocks receive its host blocks, then its
        table grows to cover ``num_tokens``."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has blocks"
        n = len(self.host.swapped[seq_id])
        if n > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {n} blocks to swap in, {len(self._free)} free")
        self._tables[seq_id] = table = [self._take() for _ in range(n)]
        self.host.swap_in_seq(seq_id, table)
        self._chain[seq_id] = []   # its full blocks are published again by ``register``
        self.grow(seq_id, num_tokens)

    def drop_swapped(self, seq_id: int) -> None:
        if self.host is not None:
            self.host.drop_seq(seq_id)

    @property
    def copies_pending(self) -> bool:
        """Host-tier copies wait for the next step to carry them."""
        return self.host is not None and bool(self.host.swap_in or self.host.swap_out)

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host-tier copies (swap_out, swap_in) the step being sent carries."""
        if self.host is None:
            return [], []
        return self.host.take_ops()
