"""Latency-aware chunking: how many prompt tokens each prefill computes in one step, so that a
step that carries decodes stays within an inter-token-latency budget and a short prompt never
waits behind a long prompt's chunks.

The scheduler gives running decodes their tokens first; what is left of ``--max-batched-tokens``
is the step's *prefill budget*, shared by its prefills (running ones, then waiting ones, in the
policy's order) by these rules:

1. **ITL budget.** While the step carries decodes, its prefill chunks add at most
   ``max_prefill_tokens_with_decodes`` tokens (``--max-prefill-tokens-with-decodes``): the
   decodes' next token waits for the whole step, so the prompt work riding along must stay
   small. A step without decodes (nobody is waiting for a next token) fills the token budget.
2. **Short prompts pass long ones.** A prefill with more than ``long_threshold`` tokens left
   is *long*. At most ``max_long_partial_prefills`` long ones keep their place in the order;
   the others move behind every short one (vLLM V0's ``max_long_partial_prefills``: "shorter
   prompts jump the queue in front of longer prompts").
3. **A fair split.** The first ``max_num_partial_prefills`` prefills of that order share the
   prefill budget max-min fairly (water filling): a prefill that needs less than an even
   share gets all it needs, the long ones split the rest evenly. Budget one of them leaves
   unused (its prompt hit the prefix cache, its blocks did not fit) goes to the next in order,
   and so does whatever remains after them, so no step is left part empty while prompt work
   waits. A long prefill alone gets the whole budget (a 30k-token prompt is not slowed down).
4. ``long_prefill_token_threshold`` > 0 (``--long-prefill-token-threshold``) also caps every
   prefill's chunk at that many tokens per step, as vLLM V1 does; 0 (the default) caps nothing
   and classifies prefills as long above ``max_prefill_tokens_with_decodes //
   max_num_partial_prefills`` tokens (more than their even share of a decode step).

So, with the defaults (2048 tokens with decodes, 4 partial prefills, 1 long): a prompt of up to
512 tokens that arrives while a long one is being chunked is computed whole in the very next
step, beside the long one's chunk; the long one is not starved either (it keeps at least an
even share of every step it is in); and a step of 256 decodes carries at most 2048 prompt
tokens whatever ``--max-batched-tokens`` allows a step of prompts alone. 2048 is the engine's
own default step budget (a server with the defaults steps as before); W1 and W3, which raise
``--max-batched-tokens`` to 16384 and 8192 for throughput, lose ~1.3% to it in
``bench.chunking_sim``'s step model while W3's longest decode step (Llama-3.1-8B) falls from
~176 to ~58 ms (docs/scheduling.md, *Latency-aware chunking*).

**Why tokens, not time.** The budget could be a time (an ITL target divided by the step-cost
slope that ``headrace.controlplane.kv.tier_cost.StepFit`` fits from step results). It is in tokens because
a token budget is deterministic (the same trace gives the same steps, so the scheduler's
property tests and a benchmark's runs are reproducible, and no feedback loop between chunk
sizes and measured step times can oscillate), because step time is close to affine in tokens
for a given model and GPU (the operator converts once: budget = (ITL target - decode step) /
cost per token), and because the fit is weakest exactly where the budget matters: it sees
device time only on a GPU (the host half of an eager mixed step is missing), it knows nothing
until it has seen steps of varied sizes (at start-up, in the first burst) and it describes the
steps already run, not the shape of the next one.
"""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES = 2048
DEFAULT_MAX_NUM_PARTIAL_PREFILLS = 4
DEFAULT_MAX_LONG_PARTIAL_PREFILLS = 1


@dataclasses.dataclass(frozen=True)
class Chunking:
    max_prefill_tokens_with_decodes: int = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES
    max_num_partial_prefills: int = DEFAULT_MAX_NUM_PARTIAL_PREFILLS
    max_long_partial_prefills: int = DEFAULT_MAX_LONG_PARTIAL_PREFILLS
    long_prefill_token_threshold: int = 0   # 0: no per-prefill cap; long = above an even share

    def __post_init__(self):
        for name in ("max_prefill_tokens_with_decodes", "max_num_partial_prefills",
                     "max_long_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError("max_long_partial_prefills must be <= max_num_partial_prefills")

    @property
    def long_threshold(self) -> int:
        """Tokens left above which a prefill is long."""
        return self.long_prefill_token_threshold or max(
            1, self.max_prefill_tokens_with_decodes // self.max_num_partial_prefills)

    def prefill_budget(self, budget: int, with_decodes: bool) -> int:
        """Tokens this step's prefills may compute, of ``budget`` left after its decodes."""
        return min(budget, self.max_prefill_tokens_with_decodes) if with_decodes else budget

    def order(self, prefills: list, need) -> list:
        """``prefills`` (in service order) with long ones beyond ``max_long_partial_prefills``
        moved behind every short one; ``need(x)``: the tokens ``x`` has left to prefill."""
        threshold, kept_long = self.long_threshold, 0
        first, deferred = [], []
        for x in prefills:
            if need(x) > threshold:
                if kept_long >= self.max_long_partial_prefills:
                    deferred.append(x)
                    continue
                kept_long += 1
            first.append(x)
        return first + deferred

    def shares(self, needs: list[int], budget: int) -> list[int]:
        """The shares of ``budget`` of the first ``max_num_partial_prefills`` prefills in
        service order (``needs``: their tokens left), max-min fair, each at most the
        per-prefill cap; the prefills after them run on what these leave."""
        cap = self.long_prefill_token_threshold
        wants = needs[:self.max_num_partial_prefills]
        return water_fill([min(n, cap) for n in wants] if cap else wants, budget)

    def cap(self, tokens: int) -> int:
        """``tokens`` within the per-prefill cap (vLLM V1's threshold; none when it is 0)."""
        cap = self.long_prefill_token_threshold
        return min(tokens, cap) if cap else tokens


def water_fill(wants: list[int], budget: int) -> list[int]:
    """Max-min fair integer shares of ``budget``: each gets min(want, level), the level as high
    as the budget allows; units left by rounding go to the first of those cut at the level."""
    shares = [0] * len(wants)
    left, pending = budget, sorted(range(len(wants)), key=lambda i: wants[i])
    while pending and left > 0:
        level = left // len(pending)
        i = pending[0]
        if wants[i] <= level:   # the smallest fits under an even share: it gets all it wants
            shares[i] = wants[i]
            left -= wants[i]
            pending.pop(0)
            continue
        for i in pending:       # the rest are cut at the level, the remainder spread in order
            shares[i] = level
        left -= level * len(pending)
        for i in sorted(pending)[:left]:
            shares[i] += 1
        break
    return shares
