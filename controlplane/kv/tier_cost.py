"""The host KV tier's cost rule (``--kv-offloading-policy``): whether a prefix hit found in
the host tier is loaded (copied back to the device) or recomputed, whichever is cheaper, both
priced from the data plane's own measurements at start.

Loading a host block costs ``load_s_per_block``: the data plane's KV bytes per block (its
rank's shard, ``WorkerInfo.kv_bytes_per_block``) over the host-to-device rate it measured on
its pinned pool through the load path itself (block-sized copies on its copy stream, then the
scatter into the KV cache: ``WorkerInfo.host_kv_load_bytes_per_s``; the slowest rank's under
tensor parallelism: every rank copies its shard at once, the step waits for the last).

Recomputing a token costs ``recompute_s_per_token``: the slope of prefill time against
tokens over the prefills the data plane timed at start at the step sizes the scheduler emits
(up to ``--max-batched-tokens``; ``WorkerInfo.prefill_profile_tokens`` / ``_seconds``, one
sequence from position 0 as the runner runs it: device time on a GPU). The slope, not time
over tokens: a step's fixed part (launches, sampling) is paid whatever its size. Session 8's
rule fitted whole step times online instead, decodes and all, and priced Qwen3-0.6B's
recompute at 78-96 us per token where a prefill costs a few: it loaded every hit. The slowest
rank's slope under tensor parallelism.

``cut`` picks how many leading hits to adopt, k, minimizing
``load_s_per_block * (host blocks among hits[:k]) + recompute_s_per_token * block_size *
(len(hits) - k)``: device hits are free, so this loads a host block only where that is
cheaper than recomputing it (ties recompute), and a host block is loaded anyway when device
hits beyond it make the rest worth it. Without both estimates (a data plane that measured
neither) ``auto`` loads, the tier's behaviour without a rule; ``always`` loads every hit,
``never`` none (the tier then serves swap preemption only); ``off`` leaves the workers' host
tiers unused, as if they had none (``Engine``: one data plane, compared with and without its
tier by restarting only the control plane). A host block not loaded stays
cached in the host tier, in its LRU place. Where ``auto`` recomputes even a lone host block
(the copy dearer than the tokens: Qwen3-0.6B on an H200), evicted blocks are not written
back at all (``keeps_evicted``): they would only cost copies. Either way a sequence's tokens
are the same: a recomputed block holds the KV of the same tokens. SGLang's HiCache has only
a fixed floor
(``load_back_threshold``, 10 tokens).
"""

from __future__ import annotations

import logging

log = logging.getLogger("headrace.engine")

POLICIES = ("auto", "always", "never", "off")   # off: the workers' host tiers are not used


def prefill_slope(tokens, seconds) -> float | None:
    """Seconds per extra token: the least-squares slope of a prefill profile (None with fewer
    than two sizes, or a slope that is not positive)."""
    points = [(float(n), float(s)) for n, s in zip(tokens, seconds) if n > 0 and s > 0]
    if len({n for n, _ in points}) < 2:
        return None
    mean_n = sum(n for n, _ in points) / len(points)
    mean_s = sum(s for _, s in points) / len(points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in points) / var
    return slope if slope > 0 else None


class TierCost:
    def __init__(self, policy: str = "auto", load_s_per_block: float | None = None,
                 block_size: int = 16, recompute_s_per_token: float | None = None):
        if policy not in POLICIES:
            raise ValueError(f"--kv-offloading-policy {policy!r}: choose from {POLICIES}")
        self.policy = policy
        self.load_s_per_block = load_s_per_block or None            # 0: not measured
        self.block_size = block_size
        self.recompute_s_per_token = recompute_s_per_token or None  # 0: not measured
        self.profile: list[tuple[int, float]] = []   # (tokens, seconds) of the slowest rank
        self.skipped_tokens = 0     # host-hit tokens recomputed instead of loaded (metrics)

    @classmethod
    def for_workers(cls, policy: str, infos, blocks) -> "TierCost | None":
        """The rule for a worker group's block manager ``blocks`` (None without a host tier):
        loading costs its largest block over its slowest copy rate, recomputing the steepest
        rank's prefill slope."""
        if blocks.host is None:
            return None
        rates = [i.host_kv_load_bytes_per_s for i in infos]
        load = max(i.kv_bytes_per_block for i in infos) / min(rates) if min(rates) > 0 else None
        slopes = [prefill_slope(i.prefill_profile_tokens, i.prefill_profile_seconds) for i in infos]
        rule = cls(policy, load, blocks.block_size, None if None in slopes else max(slopes))
        if rule.recompute_s_per_token is not None:
            slowest = infos[slopes.index(rule.recompute_s_per_token)]
            rule.profile = list(zip(slowest.prefill_profile_tokens, slowest.prefill_profile_seconds))
        return rule

    @property
    def load_s_per_token(self) -> float | None:
        return None if self.load_s_per_block is None else self.load_s_per_block / self.block_size

    def load_seconds(self, num_blocks: int) -> float:
        """The copy time of ``num_blocks`` host blocks (0 when the rate is not known)."""
        return (self.load_s_per_block or 0.0) * num_blocks

    def loads(self) -> bool | None:
        """Whether ``auto`` loads a lone host block (None: not known, so it does)."""
        r = self.recompute_s_per_token
        if self.load_s_per_block is None or r is None:
            return None
        return self.load_s_per_block < r * self.block_size

    def keeps_evicted(self) -> bool:
        """Whether evicted device blocks are worth writing back to the host tier: not where
        ``auto`` would recompute every lone host hit (each write-back would be a copy and a
        gather for nothing; the tier then serves swap preemption only)."""
        return self.policy != "auto" or self.loads() is not False

    def cut(self, hits: list[int]) -> int:
        """How many leading prefix hits to adopt (a host hit is negative: ``~host_block``)."""
        if self.policy == "always" or not any(b < 0 for b in hits):
            return len(hits)
        if self.policy == "never":
            return next(i for i, b in enumerate(hits) if b < 0)
        r, c = self.recompute_s_per_token, self.load_s_per_block
        if r is None or c is None:
            return len(hits)
        per_block = r * self.block_size
        best_k, best, cost = 0, 0.0, 0.0   # cost(k) - cost(0), with cost(0) = all recomputed
        for k, b in enumerate(hits, 1):
            cost += (c if b < 0 else 0.0) - per_block
            if cost < best:
                best_k, best = k, cost
        return best_k

    def skipped(self, hits: list[int]) -> None:
        """Counts the host hits an admission left for recompute (after ``cut``)."""
        self.skipped_tokens += sum(self.block_size for b in hits if b < 0)

    def describe(self) -> str:
        """The rule, its estimates and ``auto``'s verdict, for the tiers' startup line."""
        text = f"offloading policy {self.policy}"
        load, recompute = self.load_s_per_token, self.recompute_s_per_token
        text += f", host load {load * 1e6:.2f} us/token" if load is not None else ", load rate not measured"
        if recompute is None:
            return text + ", recompute cost not measured"
        text += f", recompute {recompute * 1e6:.2f} us/token"
        if self.profile:
            text += " (prefills of " + ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in self.profile) + ")"
        verdict = self.loads()
        if self.policy == "auto" and verdict is not None:
            text += "; host hits are " + ("loaded" if verdict else
                                          "recomputed, evicted blocks not written back")
        return text
