"""Host-tier loads started ahead of the compute that reads them (SGLang HiCache's prefetch,
vLLM's offloading connector's asynchronous loads): a waiting sequence whose admission loads
host-tier blocks (prefix hits the cost rule adopts, or its own KV after a swap preemption)
takes those blocks at once, their copies go out with the step being built, and it stays
waiting, computed only once they should have landed, while the running sequences' steps go
on. The data plane runs the copies on a copy stream of their own and makes a step wait only
for the blocks it reads (``headrace.dataplane.kv_transfer``), so the copy overlaps the steps between
instead of stalling one with the whole batch in it.

When it should have landed is an estimate: the copies queue on one link, each host block
costing the load time the data plane measured (``TierCost.load_seconds``), so a sequence's
loads are expected done ``blocks x load`` after the later of now and the previous loads'
end. A wrong estimate costs time, never correctness: a step that reads a block still being
copied waits for it on the device. With nothing running there is nothing to overlap, and the
sequence is computed in the step that loads it. Up to ``LOOK_AHEAD`` waiting sequences that
the step has no budget or room for get their loads started too (prefetch while it queues),
while fewer than that many are deferred; no more sequences are deferred at once than may run
(beyond that, one is computed in the step that loads it).

A deferred sequence holds its blocks while it waits; when a running one needs blocks that are
not there, deferred ones give theirs back first, newest first (``release``): the loaded
blocks stay in the device prefix cache, where its admission finds them again. So do they
when nothing runs and a waiting sequence (deferred or not) does not fit: no running sequence
will ever free a block then, and deferred ones that each need one more would wait forever.
"""

from __future__ import annotations

from headrace.controlplane.scheduling import admission
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.requests.request import Sequence
from headrace.controlplane.kv.tier_cost import TierCost

LOOK_AHEAD = 4   # waiting sequences beyond the step's budget or room whose loads may start


class Prefetch:
    def __init__(self, blocks: BlockManager, cost: TierCost | None, clock):
        self.blocks, self.cost, self.clock = blocks, cost, clock
        self.enabled = blocks.host is not None
        self.ready_at: dict[int, float] = {}   # deferred seq id -> when its loads should be done
        self._deferred: dict[int, Sequence] = {}
        self._link_free = 0.0                  # when the loads sent so far should be done
        self._probed: set[int] = set()         # looked ahead once, nothing to load then
        self.num_deferred = 0                  # sequences whose compute waited for loads (metrics)

    @property
    def held(self) -> int:
        """Deferred sequences (each holds the blocks it loads)."""
        return len(self._deferred)

    def loading(self, seq: Sequence, now: float) -> bool:
        """Deferred, and its loads are not expected done yet."""
        return self.ready_at.get(seq.seq_id, now) > now

    def admit(self, seq: Sequence, budget: int, reserve: int, busy: bool) -> int | None:
        """``admission.admit`` for ``seq``, its loads deferred ahead of its compute when
        ``busy`` (other sequences run meanwhile): None when deferred now."""
        before = self._loads_queued()
        n = admission.admit(self.blocks, seq, budget, reserve, self.cost, busy and self.enabled)
        if n is None:
            self._defer(seq, self._loads_queued() - before)
        elif n:
            self.forget(seq)
        return n

    def look_ahead(self, waiting: list[Sequence], reserve: int) -> None:
        """Starts the loads of the first few ``waiting`` sequences that have some (those the
        step had no budget or room for), in order, while the blocks allow."""
        if not self.enabled:
            return
        tried = 0
        for seq in waiting:
            if tried >= LOOK_AHEAD or len(self._deferred) >= LOOK_AHEAD:
                return
            sid = seq.seq_id
            if sid in self._deferred or sid in self._probed or seq.num_inflight:
                continue
            tried += 1
            if self.admit(seq, 0, reserve, busy=True) is None:
                continue
            if self.blocks.num_free <= reserve:
                return
            self._probed.add(sid)   # nothing to load (or no room): not probed again

    def _loads_queued(self) -> int:
        return len(self.blocks.host.swap_in) if self.enabled else 0

    def _defer(self, seq: Sequence, num_blocks: int) -> None:
        now = self.clock()
        load = self.cost.load_seconds(num_blocks) if self.cost is not None else 0.0
        self._link_free = max(now, self._link_free) + load
        self.ready_at[seq.seq_id] = self._link_free
        self._deferred[seq.seq_id] = seq
        self.num_deferred += 1

    def forget(self, seq: Sequence) -> None:
        """``seq`` is computed, finished or aborted: no longer deferred."""
        self.ready_at.pop(seq.seq_id, None)
        self._deferred.pop(seq.seq_id, None)
        self._probed.discard(seq.seq_id)

    def release(self, keep: Sequence | None = None) -> bool:
        """Gives back the blocks of the newest deferred sequence other than ``keep`` (it waits
        again, from its prompt: its loaded prefix hits stay cached on the device); False when
        none is."""
        seq = next((s for s in reversed(self._deferred.values()) if s is not keep), None)
        if seq is None:
            return False
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        self.forget(seq)
        return True

    def reset(self) -> None:
        """The workers lost their state: every deferred sequence gives its blocks back."""
        while self.release():
            pass
        self._link_free = 0.0
        self._probed.clear()

    def retry_after(self, now: float) -> float | None:
        """Seconds until the first deferred sequence's loads should be done (None: none)."""
        if not self.ready_at:
            return None
        return max(0.0, min(self.ready_at.values()) - now)
