"""Continuous-batching scheduler (FIFO): decides, every step, which requests run and how
many tokens each computes, and keeps their block tables in step.

Each step: running requests decode first (preempting the newest by recompute when blocks
run out), then waiting requests are admitted in arrival order while the token budget,
the running cap and free blocks allow. Finished requests leave at once and free their blocks.
"""

from __future__ import annotations

import collections
import dataclasses

from controlplane.block_manager import BlockManager
from controlplane.request import Request, Status


@dataclasses.dataclass
class ScheduledStep:
    new: list[tuple[Request, int]] = dataclasses.field(default_factory=list)
    running: list[tuple[Request, int, list[int]]] = dataclasses.field(default_factory=list)
    forget: list[int] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.new and not self.running

    def scheduled(self) -> list[tuple[Request, int]]:
        return self.new + [(r, n) for r, n, _ in self.running]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_batched_tokens: int):
        self.blocks = blocks
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._forget: list[int] = []   # seq ids the workers must drop before the next step
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.seq_id)
        if req.on_worker:
            self._forget.append(req.seq_id)
            req.on_worker = False

    def finish(self, req: Request, reason: int) -> None:
        """Retires a request (finished, aborted or failed) and frees its blocks at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self._release(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget < 1:
                continue
            while not self.blocks.can_grow(req.seq_id, req.num_computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            new_blocks = self.blocks.grow(req.seq_id, req.num_computed + 1)
            step.running.append((req, 1, new_blocks))
            budget -= 1
        # A preempted request may have been scheduled before the victim choice reached it.
        step.running = [e for e in step.running if e[0].status is Status.RUNNING]
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed
            if n > budget or not self.blocks.can_grow(req.seq_id, req.num_tokens):
                break
            self.waiting.popleft()
            self.blocks.grow(req.seq_id, req.num_tokens)
            req.status, req.on_worker = Status.RUNNING, True
            self.running.append(req)
            step.new.append((req, n))
            budget -= n
        step.forget, self._forget = self._forget, []
        return step

    def after_step(self, step: ScheduledStep) -> None:
        """Advances every request the step computed (before its sampled tokens are appended)."""
        for req, n in step.scheduled():
            if req.status is Status.RUNNING:
                req.num_computed += n
