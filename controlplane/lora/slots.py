"""Which LoRA adapter each device slot of the data planes holds, and which adapters their host
caches hold: the control plane's decisions, least recently used first (S-LoRA's and vLLM's
rule), which the workers follow (``worker.proto``: ``LoadAdapter`` fills a host cache, a
step's ``lora_loads`` fill slots).

``acquire`` gives a waiting sequence's adapter a slot before the scheduler admits it: the slot
it holds already, else a free one, else the least recently used slot whose adapter no running
sequence uses (a slot in use is never taken); the copy into it goes out with the step
(``take_ops``). The adapter must be in the host caches first (``Adapter.cached``): while it
is not, ``acquire`` says no and the caller starts its read (``headrace.controlplane.lora.registry``). The host
cache keeps ``capacity`` adapters and drops the least recently used first (``make_room``);
an adapter in a slot stays usable there even when its host copy is dropped.

Every read of an adapter into the host caches has an id of its own (``cache_id``, never
reused), and drops ride on the steps, after the loads they carry: a step in flight that loads
an adapter reads its copy before a later step's drop removes it, and a drop of an old copy
never touches a newer read of the same adapter (reads run beside the steps).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import typing

_clock = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Adapter:
    """A LoRA adapter the server serves (``headrace.controlplane.lora.registry.LoraAdapters`` owns them)."""

    name: str
    path: str
    id: int                  # the control plane's id: the workers' host-cache key, never reused
    rank: int = 0            # from the workers, once read
    root: int = 0            # the root of its prompt blocks' hash chain (from the fingerprint)
    error: str = ""          # why the workers refused it
    cached: bool = False     # in every worker's host cache
    slot: int | None = None  # the device slot holding it (0-based)
    used: int = 0            # last use, for the LRU rules
    unloading: bool = False  # new requests refused; forgotten once its sequences are done
    loading: typing.Any = None   # the host-cache read in flight (an asyncio task)
    cache_id: int = 0        # the workers' host-cache key of its current copy (a read's own)

    def touch(self) -> None:
        self.used = next(_clock)


class Slots:
    def __init__(self, num_slots: int, capacity: int):
        self.num_slots, self.capacity = num_slots, capacity
        self.held: list[Adapter | None] = [None] * num_slots
        self.cache: collections.OrderedDict[int, Adapter] = collections.OrderedDict()
        self._loads: list[tuple[int, int]] = []   # (slot, cache id) not yet sent
        self._drops: list[int] = []               # host copies to drop (cache ids), not yet sent
        self._claimed: set[int] = set()           # adapters given a slot in the step being built
        self.num_loads = 0

    def begin_step(self) -> None:
        """A step is being built: the adapters it gives slots are kept until it is sent."""
        self._claimed.clear()

    def acquire(self, adapter: Adapter, running) -> bool:
        """Whether ``adapter`` is (now) in a slot; ``running``: the running sequences (their
        adapters' slots are not taken, nor those claimed in the step being built)."""
        adapter.touch()
        if adapter.slot is not None:
            self._claimed.add(adapter.id)
            return True
        if not adapter.cached:
            return False
        slot = next((i for i, a in enumerate(self.held) if a is None), None)
        if slot is None:
            busy = {s.lora.id for s in running if s.lora is not None} | self._claimed
            free = [i for i, a in enumerate(self.held) if a.id not in busy]
            if not free:
                return False
            slot = min(free, key=lambda i: self.held[i].used)
            self.held[slot].slot = None
        self.held[slot], adapter.slot = adapter, slot
        self._claimed.add(adapter.id)
        self._loads.append((slot, adapter.cache_id))
        self.num_loads += 1
        if adapter.id in self.cache:
            self.cache.move_to_end(adapter.id)
        return True

    @property
    def pending(self) -> bool:
        """Loads or drops wait for a step to carry them."""
        return bool(self._loads or self._drops)

    def take_ops(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What the step being sent carries: slot loads (slot 0-based, cache id), then host
        copies to drop (cache ids)."""
        loads, drops, self._loads, self._drops = self._loads, self._drops, [], []
        return loads, drops

    # -- the host caches -----------------------------------------------------------------------
    def make_room(self, adapter: Adapter, reserved: int = 0) -> list[Adapter]:
        """Adapters to drop from the host caches so ``adapter`` fits beside ``reserved`` others
        being read (least recently used first, those outside a slot before those in one); they
        are no longer ``cached``."""
        out: list[Adapter] = []
        if adapter.id in self.cache:
            return out
        while len(self.cache) + reserved + 1 > self.capacity and self.cache:
            victims = [a for a in self.cache.values() if a.slot is None] or list(self.cache.values())
            victim = min(victims, key=lambda a: a.used)
            del self.cache[victim.id]
            victim.cached = False
            self._drops.append(victim.cache_id)
            out.append(victim)
        return out

    def cached(self, adapter: Adapter) -> None:
        """``adapter`` is in every worker's host cache now."""
        adapter.cached = True
        self.cache[adapter.id] = adapter

    def forget(self, adapter: Adapter) -> None:
        """``adapter`` is no longer served: out of its slot and the host caches."""
        if adapter.slot is not None:
            self.held[adapter.slot] = None
            adapter.slot = None
        if self.cache.pop(adapter.id, None) is not None:
            self._drops.append(adapter.cache_id)
        adapter.cached = False

    def reset(self) -> None:
        """The workers lost their state (restarted, or a reload): nothing is in a slot or a
        host cache any more; each adapter is read again when next needed."""
        for adapter in self.held:
            if adapter is not None:
                adapter.slot = None
        for adapter in self.cache.values():
            adapter.cached = False
        self.held = [None] * self.num_slots
        self.cache.clear()
        self._loads.clear()
        self._drops.clear()
