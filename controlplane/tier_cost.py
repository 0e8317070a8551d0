"""The host KV tier's cost rule (``--kv-offloading-policy``): whether a prefix hit found in
the host tier is loaded (copied back to the device) or recomputed, whichever is cheaper.

Loading a host block costs ``load_s_per_block``: the data plane's KV bytes per block (its
rank's shard, ``WorkerInfo.kv_bytes_per_block``) over the host-to-device rate it measured
at start on its pinned pool, through the swap-in path (``WorkerInfo.host_kv_load_bytes_per_s``;
the slowest rank's under tensor parallelism: every rank copies its shard at once, the step
waits for the last). Recomputing a token costs the marginal step time of one more token,
``recompute_s_per_token``: the slope of step time against tokens computed, fitted online by
exponentially weighted least squares over the step results (``StepFit``; device time on a
GPU, host time on a CPU; steps that waited for a swap-in, and GPU steps without a device time,
prefill chunks that sample nothing, are left out). The slope, not the
average time per token: a step's fixed cost (launches, sampling) is paid whatever its size,
and on a small model it dominates, so time/tokens would make recompute look dearer than it
is exactly where it is cheap (Qwen3-0.6B on an H200: ~4.2 us/token to load over PCIe, about
as much or less to recompute; Llama-3.1-8B: recompute ~6x dearer than the copy).

``cut`` picks how many leading hits to adopt, k, minimizing
``load_s_per_block * (host blocks among hits[:k]) + recompute_s_per_token * block_size *
(len(hits) - k)``: device hits are free, so this loads a host block only where that is
cheaper than recomputing it (ties recompute), and a host block is loaded anyway when device
hits beyond it make the rest worth it. Until the fit has seen enough steps with varied sizes
(or when the data plane did not measure its copy rate) ``auto`` loads, the tier's behaviour
without a rule; ``always`` loads every hit, ``never`` none (the tier then serves swap
preemption only). A host block not loaded stays cached in the host tier, in its LRU place.
Either way a sequence's tokens are the same: a recomputed block holds the KV of the same
tokens. SGLang's HiCache has only a fixed floor (``load_back_threshold``, 10 tokens).
"""

from __future__ import annotations

import logging

log = logging.getLogger("headrace.engine")

POLICIES = ("auto", "always", "never")
HALF_LIFE_STEPS = 64     # the fit forgets a step's weight by half after this many steps
MIN_STEPS = 8            # steps seen before the slope is trusted
MIN_SPREAD = 0.1         # ... and their sizes' standard deviation over their mean at least


class StepFit:
    """Step time against tokens computed, exponentially weighted (incremental means, variance
    and covariance, West's update): the slope is seconds per extra token. ``slope`` is None
    until enough varied steps were seen; afterwards it keeps its last good value while recent
    steps are too alike to fit."""

    def __init__(self, half_life: int = HALF_LIFE_STEPS):
        self.alpha = 1.0 - 0.5 ** (1.0 / half_life)
        self.steps = 0
        self.mean_n = self.mean_t = self.var_n = self.cov = 0.0
        self.slope: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0.0:
            return
        self.steps += 1
        if self.steps == 1:
            self.mean_n, self.mean_t = float(tokens), seconds
            return
        a, dn, dt = self.alpha, tokens - self.mean_n, seconds - self.mean_t
        self.mean_n += a * dn
        self.mean_t += a * dt
        self.var_n = (1.0 - a) * (self.var_n + a * dn * dn)
        self.cov = (1.0 - a) * (self.cov + a * dn * dt)
        if self.steps >= MIN_STEPS and self.var_n > (MIN_SPREAD * self.mean_n) ** 2:
            slope = self.cov / self.var_n
            if slope > 0.0:
                self.slope = slope


class TierCost:
    def __init__(self, policy: str = "auto", load_s_per_block: float | None = None,
                 block_size: int = 16, fit: StepFit | None = None):
        if policy not in POLICIES:
            raise ValueError(f"--kv-offloading-policy {policy!r}: choose from {POLICIES}")
        self.policy = policy
        self.load_s_per_block = load_s_per_block or None   # 0: not measured
        self.block_size = block_size
        self.fit = fit or StepFit()
        self.skipped_tokens = 0     # host-hit tokens recomputed instead of loaded (metrics)
        self._verdict: bool | None = None   # the last logged one: load (True) or recompute

    @classmethod
    def for_workers(cls, policy: str, infos, blocks) -> "TierCost | None":
        """The rule for a worker group's block manager ``blocks`` (None without a host tier):
        loading costs its largest block over its slowest copy rate."""
        if blocks.host is None:
            return None
        rates = [i.host_kv_load_bytes_per_s for i in infos]
        load = max(i.kv_bytes_per_block for i in infos) / min(rates) if min(rates) > 0 else None
        return cls(policy, load, blocks.block_size)

    @property
    def recompute_s_per_token(self) -> float | None:
        return self.fit.slope

    @property
    def load_s_per_token(self) -> float | None:
        return None if self.load_s_per_block is None else self.load_s_per_block / self.block_size

    def loads(self) -> bool | None:
        """Whether ``auto`` loads a lone host block now (None: not known, so it does)."""
        r = self.fit.slope
        if self.load_s_per_block is None or r is None:
            return None
        return self.load_s_per_block < r * self.block_size

    def cut(self, hits: list[int]) -> int:
        """How many leading prefix hits to adopt (a host hit is negative: ``~host_block``)."""
        if self.policy == "always" or not any(b < 0 for b in hits):
            return len(hits)
        if self.policy == "never":
            return next(i for i, b in enumerate(hits) if b < 0)
        r, c = self.fit.slope, self.load_s_per_block
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

    def observe(self, step, result, on_device: bool) -> None:
        """Feeds a step's size and time to the fit (not a step that waited for swap-ins);
        logs when ``auto``'s verdict on host hits changes."""
        if step.swap_in:
            return
        seconds = (result.device_ms if on_device else result.execute_ms) / 1e3
        self.fit.observe(step.num_tokens + sum(step.running.num_spec), seconds)
        verdict = self.loads()
        if verdict is not None and verdict != self._verdict and self.policy == "auto":
            self._verdict = verdict
            log.info("KV offloading policy auto: host hits are %s (load %.2f us/token, "
                     "recompute %.2f us/token)", "loaded" if verdict else "recomputed",
                     self.load_s_per_token * 1e6, self.recompute_s_per_token * 1e6)

    def describe(self) -> str:
        """The rule and its estimates, for the tiers' startup line."""
        load = self.load_s_per_token
        text = f"offloading policy {self.policy}"
        if load is not None:
            text += f", host load {load * 1e6:.2f} us/token"
        return text + ", recompute cost fitted from step times"
