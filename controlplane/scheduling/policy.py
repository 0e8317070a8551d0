"""Scheduling policies: the order in which waiting work is admitted and running work is
served, and which running sequence is preempted first.

Every policy ranks by a base value minus ``aging_rate`` times the seconds a sequence has
waited (starvation protection); lower ranks go first. ``max_queue_delay`` is a latency
guarantee on top: a sequence waiting longer is admitted ahead of the policy order.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from headrace.controlplane.requests.request import Sequence

POLICIES = ("fifo", "priority", "sjf")
# Rank units a second of waiting is worth, by default: a priority level every 10 s; for
# shortest-job-first, 100 tokens of estimated work per second waited.
DEFAULT_AGING = {"fifo": 0.0, "priority": 0.1, "sjf": 100.0}


def remaining_work(seq: Sequence) -> int:
    """Tokens left to compute: prompt (and resumed) tokens to prefill plus tokens to generate."""
    return (seq.num_tokens - seq.num_computed) + (seq.max_tokens - len(seq.output_token_ids))


_BASE: dict[str, Callable[[Sequence], float]] = {
    "fifo": lambda s: 0.0,
    "priority": lambda s: float(s.priority),
    "sjf": lambda s: float(remaining_work(s)),
}


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str = "fifo"
    aging_rate: float | None = None         # None: the policy's default
    max_queue_delay: float | None = None    # seconds; None: no guarantee

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose from {POLICIES}")
        if self.aging_rate is not None and self.aging_rate < 0:
            raise ValueError("aging_rate must be >= 0")
        if self.max_queue_delay is not None and self.max_queue_delay <= 0:
            raise ValueError("max_queue_delay must be > 0")

    @property
    def aging(self) -> float:
        return DEFAULT_AGING[self.name] if self.aging_rate is None else self.aging_rate

    def rank(self, seq: Sequence, now: float) -> tuple:
        """Sort key of the service order (lower first): aged base, then arrival."""
        return (_BASE[self.name](seq) - self.aging * (now - seq.waiting_since), seq.arrival, seq.seq_id)

    def victim_key(self, seq: Sequence) -> tuple:
        """Preemption order (higher first): lowest priority / longest remaining / newest."""
        return (_BASE[self.name](seq), seq.arrival, seq.seq_id)

    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        if self.max_queue_delay is None:
            return sorted(waiting, key=lambda s: self.rank(s, now))
        late = [s for s in waiting if now - s.waiting_since >= self.max_queue_delay]
        on_time = [s for s in waiting if now - s.waiting_since < self.max_queue_delay]
        return (sorted(late, key=lambda s: (s.waiting_since, s.seq_id))
                + sorted(on_time, key=lambda s: self.rank(s, now)))
