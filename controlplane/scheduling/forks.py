"""Parallel samples (``n > 1``) of one request as the scheduler keeps them: children wait
beside their parent until its prompt is computed, then fork from it — sharing its prompt
blocks and copying the block holding the last prompt token, which each recomputes (so its
first sample is its own). A child forked this way runs at once but is sent to the workers
by the next step (``take_unsent``); one that cannot fork (no slot or no free block) waits
like any sequence and computes its prompt from the prefix cache."""

from __future__ import annotations

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.requests.request import Sequence, Status
from headrace.controlplane.scheduling.step import NewSeq, ScheduledStep


class Forks:
    def __init__(self):
        self.pending: dict[int, list[Sequence]] = {}   # parent seq id -> children
        self.unsent: list[Sequence] = []   # running children the workers do not know yet

    def defer(self, parent: Sequence, children: list[Sequence]) -> None:
        for child in children:
            child.status = Status.PENDING_FORK
        if children:
            self.pending[parent.seq_id] = children

    @property
    def num_pending(self) -> int:
        """Children waiting for their parent's prompt."""
        return sum(map(len, self.pending.values()))

    def orphans(self, parent: Sequence) -> list[Sequence]:
        """The children of a parent that finished: they will never fork and must wait."""
        return [c for c in self.pending.pop(parent.seq_id, []) if c.status is Status.PENDING_FORK]

    def due(self, parent: Sequence) -> list[Sequence]:
        """Children to fork now that ``parent`` computed its last prompt token (else none)."""
        if parent.seq_id in self.pending and parent.num_total == len(parent.prompt_token_ids):
            return self.pending.pop(parent.seq_id)
        return []

    def fork(self, blocks: BlockManager, parent: Sequence, child: Sequence) -> tuple[int, int]:
        """Forks ``child`` from ``parent``; returns the block copy (source, destination)."""
        last = len(parent.prompt_token_ids) - 1
        copy, child.num_cached_prompt_tokens = blocks.fork(parent.seq_id, child.seq_id, last)
        child.num_computed = last
        child.status, child.on_worker = Status.RUNNING, True
        self.unsent.append(child)
        return copy

    def send(self, step: ScheduledStep, blocks: BlockManager, budget: int, scheduled: set[int]) -> int:
        """Puts the forked children into ``step`` (one token each: the one they recompute),
        within ``budget``; returns the budget left."""
        while self.unsent and budget >= 1:
            child = self.unsent.pop(0)
            if child.status is Status.RUNNING:
                step.new.append(NewSeq(child, 1, blocks.block_ids(child.seq_id)))
                scheduled.add(child.seq_id)
                budget -= 1
        return budget

    def discard(self, seq: Sequence) -> None:
        if seq in self.unsent:
            self.unsent.remove(seq)

    def clear_unsent(self) -> None:
        self.unsent.clear()
