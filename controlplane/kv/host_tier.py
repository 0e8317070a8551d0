"""The second KV tier, in the data planes' host memory (``--kv-offloading-size``): its block
pool, its prefix-cache index and the block copies the workers must make, as the control
plane's block manager decides them (the workers only execute them).

A full, hashed block evicted from the device tier is copied here (``offload``: a ``swap_out``
pair, device block -> host block) instead of being dropped; a prefix hit on a host block is
copied back into a fresh device block (``fetch``: a ``swap_in`` pair, host block -> device
block), the host copy staying cached (SGLang's HiCache keeps it too, so evicting the device
block again costs no copy). A sequence preempted in swap mode keeps its KV in private host
blocks (``swap_out_seq``) and gets it back when resumed.

Ordering contract with the workers: a step's ``swap_out`` copies run first, then its copy-on-write
copies (a fork's source block, freed by its parent meanwhile, may be a swap-in's destination), then
its ``swap_in`` copies, then its forward pass; steps run in order. So a device block that is evicted
and reused in one step is saved first. A host block that a pending ``swap_in`` reads is pinned until
the step carrying it is taken (``take_ops``): no ``swap_out`` of the same step may overwrite it. LRU
order: unreferenced blocks that hold nothing reusable are taken first, then the least recently used
cached ones.
"""

from __future__ import annotations

import collections
import logging

log = logging.getLogger("headrace.engine")


def report(blocks, preemption_mode: str, cost=None) -> None:
    """Logs both KV tiers of a block manager (``blocks``) as the engine starts with them, and
    the host tier's cost rule (``headrace.controlplane.kv.tier_cost``)."""
    host = blocks.host.num_blocks if blocks.host is not None else 0
    log.info("KV tiers: device %d blocks, host %d blocks (%d tokens each); preemption by %s%s",
             blocks.num_blocks, host, blocks.block_size, preemption_mode,
             f"; {cost.describe()}" if cost is not None else "")
    if preemption_mode == "swap" and not host:
        log.warning("--preemption-mode swap without a host KV tier (--kv-offloading-size): "
                    "preempted requests are recomputed")


class HostTier:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a host KV tier needs at least one block")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks            # pins (pending swap-ins) + private owners
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}               # chain hash -> host block
        self.swapped: dict[int, list[int]] = {}        # swap-preempted seq id -> its host blocks
        self.swap_out: list[tuple[int, int]] = []      # pending (device block, host block)
        self.swap_in: list[tuple[int, int]] = []       # pending (host block, device block)
        self._in_dst: set[int] = set()                 # device blocks pending swap-ins write
        self._pinned: list[int] = []
        self.hits = 0              # prefix tokens found here (metrics)
        self.blocks_out = 0        # blocks copied device -> host, host -> device
        self.blocks_in = 0
        self.events = None         # the block manager's CacheEvents, when watched

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks holding something (cached or private)."""
        return 1.0 - sum(1 for b in self._free if self._hash[b] is None) / self.num_blocks

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        block = self.cached.get(h)
        if block is None or self._tokens[block] != tokens:
            return None
        return block

    def _take(self) -> int | None:
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.evicted.append(h)
            self._hash[block] = self._tokens[block] = None
        return block

    def _unref(self, block: int) -> None:
        self.ref[block] -= 1
        assert self.ref[block] >= 0, f"host block {block} released twice"
        if self.ref[block] == 0:
            self._free[block] = None
            if self._hash[block] is None:
                self._free.move_to_end(block, last=False)

    def _pin(self, block: int) -> None:
        if self.ref[block] == 0:
            del self._free[block]
        self.ref[block] += 1

    # -- the prefix cache's second tier -----------------------------------------------------
    def offload(self, device_block: int, h: int, tokens: tuple[int, ...]) -> None:
        """The device tier evicts ``device_block`` (cached as ``h``): keep a copy, unless one
        is here already (then it is only touched) or every host block is pinned."""
        block = self.cached.get(h)
        if block is not None:
            if block in self._free:
                self._free.move_to_end(block)
            return
        if device_block in self._in_dst:   # its content is not there yet: nothing to save
            return
        block = self._take()
        if block is None:
            return
        self._hash[block], self._tokens[block] = h, tokens
        self.cached[h] = block
        if self.events is not None:
            self.events.stored.append(h)
        self._free[block] = None            # cached, unreferenced: most recently used
        self.swap_out.append((device_block, block))
        self.blocks_out += 1

    def entry(self, block: int) -> tuple[int, tuple[int, ...]]:
        """The (chain hash, tokens) that ``block`` caches."""
        return self._hash[block], self._tokens[block]

    def hold(self, block: int) -> None:
        """Pins a prefix hit until the step that copies it back is taken (see ``fetch``)."""
        self._pin(block)
        self._pinned.append(block)

    def fetch(self, block: int, device_block: int, num_tokens: int) -> None:
        """A held prefix hit on ``block``: copy it into ``device_block`` before the step
        reads it."""
        self.swap_in.append((block, device_block))
        self._in_dst.add(device_block)
        self.hits += num_tokens
        self.blocks_in += 1

    # -- swap preemption --------------------------------------------------------------------
    def swap_out_seq(self, seq_id: int, device_blocks: list[int]) -> bool:
        """Copies a preempted sequence's blocks into private host blocks; False (nothing
        done) when the tier cannot hold them or one of them still waits for its swap-in."""
        if len(device_blocks) > len(self._free) or self._in_dst.intersection(device_blocks):
            return False
        blocks = []
        for d in device_blocks:
            b = self._take()
            self.ref[b] = 1
            self.swap_out.append((d, b))
            blocks.append(b)
        self.swapped[seq_id] = blocks
        self.blocks_out += len(blocks)
        return True

    def swap_in_seq(self, seq_id: int, device_blocks: list[int]) -> None:
        """Copies a resumed sequence's host blocks back into ``device_blocks`` (one each);
        the host blocks go free once the step carrying the copies is taken."""
        blocks = self.swapped.pop(seq_id)
        assert len(blocks) == len(device_blocks)
        for b, d in zip(blocks, device_blocks):
            self._pin(b)
            self._pinned.append(b)
            self.swap_in.append((b, d))
            self._in_dst.add(d)
            self._unref(b)      # the owner's reference: the pin holds it until taken
        self.blocks_in += len(blocks)

    def drop_seq(self, seq_id: int) -> None:
        """A swap-preempted sequence ended while waiting: its host blocks go free."""
        for b in self.swapped.pop(seq_id, ()):
            self._unref(b)

    # -- per step ---------------------------------------------------------------------------
    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for the step being sent, (swap_out, swap_in); unpins their sources."""
        out, into = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        for b in self._pinned:
            self._unref(b)
        self._pinned.clear()
        self._in_dst.clear()
        return out, into

    def reset(self) -> None:
        """The data plane's host memory is gone: forget every block and pending copy (the
        counters go on)."""
        counters = self.hits, self.blocks_out, self.blocks_in, self.events
        self.__init__(self.num_blocks)
        self.hits, self.blocks_out, self.blocks_in, self.events = counters
