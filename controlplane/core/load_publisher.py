"""What an engine core tells the front ends that place requests over several cores
(``Hello.placement``, ``--data-parallel-size`` > 1): every ``INTERVAL_S`` while anything changed, a
``CoreLoad`` on each such stream with the core's running and waiting sequences, its KV pool, and its
prefix caches' changes as chained block hashes (``headrace.controlplane.kv.cache_summary``; the
whole cache to a stream that just joined, and to all after a reset or a reload).

The block manager records the changes as it works (one list append per block entering or
leaving a cache); nothing else runs on the engine's step path. A message not yet sent when
the next is due is merged into it (``merge``), so a slow front end gets fewer, larger ones."""

from __future__ import annotations

import asyncio
import contextlib

from headrace.controlplane.kv.cache_summary import CacheEvents
from headrace.core.v1 import core_pb2 as cpb

INTERVAL_S = 0.02
NUMBERS = ("running", "waiting", "num_kv_blocks", "num_free_kv_blocks", "block_size")


def merge(pending: cpb.CoreLoad, load: cpb.CoreLoad) -> None:
    """``load`` follows ``pending`` (not yet sent): one message saying both. The front end
    counts each hash's presence, so the stored-before-evicted order of one message is safe."""
    if load.cache_reset:
        pending.CopyFrom(load)
        return
    for name in NUMBERS:   # the newest
        setattr(pending, name, getattr(load, name))
    pending.lora_in_slots[:] = load.lora_in_slots
    pending.lora_cached[:] = load.lora_cached
    pending.cached_hashes.extend(load.cached_hashes)
    pending.evicted_hashes.extend(load.evicted_hashes)


def _lora_state(engine) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The LoRA adapters in a device slot and in the host caches (placement prefers a core
    that has a request's adapter loaded)."""
    lora = getattr(engine, "lora", None)
    if lora is None or not lora.enabled:
        return (), ()
    adapters = lora.adapters()
    return (tuple(sorted(a.name for a in adapters if a.slot is not None)),
            tuple(sorted(a.name for a in adapters if a.cached)))


class LoadPublisher:
    def __init__(self, service, interval_s: float = INTERVAL_S):
        self.service = service      # headrace.controlplane.core.service.EngineCoreService
        self.interval_s = interval_s
        self._events = CacheEvents()
        self._blocks = None         # the block manager being watched
        self._fresh: set = set()    # links that need the whole cache
        self._last: dict = {}       # link -> the numbers it was last sent
        self._task: asyncio.Task | None = None

    def join(self, link) -> None:
        """``link``'s front end places requests: it gets the whole cache first."""
        self._fresh.add(link)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="headrace-core-load")

    def leave(self, link) -> None:
        self._fresh.discard(link)
        self._last.pop(link, None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.publish()

    def publish(self) -> None:
        """One round: each placing link whose view is behind gets its CoreLoad."""
        sched = self.service.plane.engine.scheduler
        links = [link for link in self.service.links if link.placement and not link.closed]
        if sched is None or not links:
            return
        blocks = sched.blocks
        if blocks is not self._blocks:   # a new pool (start, reload): watch it, start afresh
            self._events, self._blocks = CacheEvents(), blocks
            blocks.watch(self._events)
        reset, stored, evicted = self._events.take()
        numbers = (len(sched.running), len(sched.waiting), blocks.num_blocks, blocks.num_free,
                   blocks.block_size, *_lora_state(self.service.plane.engine))
        snapshot = None
        for link in links:
            fresh = reset or link in self._fresh
            if not fresh and not stored and not evicted and self._last.get(link) == numbers:
                continue
            load = cpb.CoreLoad(running=numbers[0], waiting=numbers[1], num_kv_blocks=numbers[2],
                                num_free_kv_blocks=numbers[3], block_size=numbers[4],
                                lora_in_slots=numbers[5], lora_cached=numbers[6])
            if fresh:
                snapshot = blocks.hashes() if snapshot is None else snapshot
                load.cache_reset = True
                load.cached_hashes.extend(snapshot)
            else:
                load.cached_hashes.extend(stored)
                load.evicted_hashes.extend(evicted)
            self._fresh.discard(link)
            self._last[link] = numbers
            link.push_load(load)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
