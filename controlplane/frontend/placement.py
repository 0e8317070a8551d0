"""Which data-parallel engine core a request goes to (``--data-parallel-placement``), decided in the
API front end from what every core publishes (``headrace.controlplane.kv.cache_summary``): its load
and the hashes its prefix cache holds. Each core then owns the request's scheduling and KV blocks as
with one core. The simulator (``bench.placement_sim``) runs the same rule.

- ``prefix`` (default): the core holding the longest cached prefix of the prompt, when that
  prefix is at least ``cache_threshold`` of the prompt's full blocks (ties: the least loaded),
  unless that core is much busier than the least loaded one: more than ``balance_abs``
  sequences more and more than ``balance_rel`` times as many (SGLang's cache-aware router's
  rule and defaults are the model: abs 32 / rel 1.5 / cache 0.5); otherwise the least loaded.
- ``least-load``: the least loaded core (vLLM's DP load balancing).
- ``round-robin``: each ready core in turn (the baseline).

Load is sequences running plus 4 x waiting (waiting means the core is saturated; vLLM's
score weighs them so too); ties rotate, so equal cores share the work. Only ready cores
(healthy, loaded, not draining) are candidates; none ready: ``choose`` returns None.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

POLICIES = ("prefix", "least-load", "round-robin")
WAITING_WEIGHT = 4


def load_score(running: int, waiting: int) -> int:
    return running + WAITING_WEIGHT * waiting


class Candidate(Protocol):
    """What placement reads of a core (``headrace.controlplane.frontend.router``, the simulator)."""

    @property
    def ready(self) -> bool: ...

    @property
    def load(self) -> int: ...

    def match(self, hashes: list[int]) -> int: ...


@dataclasses.dataclass(frozen=True)
class Choice:
    index: int        # the core, by its position in the candidates
    reason: str       # prefix | load | balance (a prefix holder passed over) | round_robin
    matched: int      # blocks of the prompt the chosen core holds (or is expected to)


class Placement:
    def __init__(self, policy: str = "prefix", balance_abs: int = 32, balance_rel: float = 1.5,
                 cache_threshold: float = 0.5):
        if policy not in POLICIES:
            raise ValueError(f"placement {policy!r}: choose from {', '.join(POLICIES)}")
        if balance_abs < 0 or balance_rel < 1 or not 0 <= cache_threshold <= 1:
            raise ValueError("placement thresholds: balance_abs >= 0, balance_rel >= 1, "
                             "0 <= cache_threshold <= 1")
        self.policy, self.balance_abs, self.balance_rel = policy, balance_abs, balance_rel
        self.cache_threshold = cache_threshold
        self._turn = 0

    def _rotation(self, cores: Sequence[Candidate]) -> list[int]:
        """The ready cores, starting one further each call (equal cores take turns)."""
        ready = [i for i, core in enumerate(cores) if core.ready]
        if not ready:
            return ready
        start, self._turn = self._turn % len(ready), self._turn + 1
        return ready[start:] + ready[:start]

    def much_busier(self, load: int, least: int) -> bool:
        return load - least > self.balance_abs and load > self.balance_rel * least

    def choose(self, cores: Sequence[Candidate], hashes: list[int]) -> Choice | None:
        """The core for a prompt whose full blocks hash to ``hashes``."""
        order = self._rotation(cores)
        if not order:
            return None
        if self.policy == "round-robin":
            return Choice(order[0], "round_robin", cores[order[0]].match(hashes) if hashes else 0)
        loads = {i: cores[i].load for i in order}
        least = min(order, key=loads.__getitem__)   # the first of the rotation among equals
        matched = {i: cores[i].match(hashes) for i in order} if hashes else dict.fromkeys(order, 0)
        if self.policy == "least-load":
            return Choice(least, "load", matched[least])
        best = max(matched.values())
        if best and best >= self.cache_threshold * len(hashes):
            holder = min((i for i in order if matched[i] == best), key=loads.__getitem__)
            if not self.much_busier(loads[holder], loads[least]):
                return Choice(holder, "prefix", best)
            return Choice(least, "balance", matched[least])
        return Choice(least, "load", matched[least])
