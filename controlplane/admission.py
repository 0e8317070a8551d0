"""How a waiting sequence gets the blocks of its next tokens when the scheduler admits it: its
prompt's cached prefix adopted from either KV tier (``BlockManager.match_prefix``), or, after a
swap preemption, its own KV copied back from the host tier. The scheduler decides who is
admitted and in what order; this decides whether the blocks fit and takes them. Host-tier
hits are adopted only as far as ``controlplane.tier_cost`` finds loading them cheaper than
recomputing them (``cost``; None: all of them); the rest of the prompt is computed.
"""

from __future__ import annotations

from controlplane.block_manager import BlockManager
from controlplane.request import Sequence
from controlplane.tier_cost import TierCost


def admit(blocks: BlockManager, seq: Sequence, budget: int, reserve: int,
          cost: TierCost | None = None) -> int:
    """Takes ``seq``'s blocks for its next tokens, at most ``budget``, leaving ``reserve``
    blocks free; sets ``num_computed`` to what its KV already holds. Returns how many tokens
    the step computes for it, 0 when its blocks do not fit (nothing taken)."""
    if blocks.is_swapped(seq.seq_id):   # its KV waits in the host tier: copied back
        start = seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
        n = min(seq.num_tokens - start, budget)
        if blocks.swap_in_cost(seq.seq_id, start + n) + reserve > blocks.num_free:
            return 0
        blocks.swap_in(seq.seq_id, start + n)
        return n
    found = blocks.match_prefix(seq.token_ids)
    hits = found if cost is None or blocks.host is None else found[:cost.cut(found)]
    cached = blocks.cached_tokens(hits)
    n = min(seq.num_tokens - cached, budget)
    if blocks.cost(hits, cached + n) + reserve > blocks.num_free:
        return 0
    blocks.adopt(seq.seq_id, hits, seq.num_tokens)
    if len(hits) < len(found):
        cost.skipped(found[len(hits):])
    blocks.grow(seq.seq_id, cached + n)
    if not seq.output_token_ids and seq.num_preemptions == 0:
        seq.num_cached_prompt_tokens = cached
    seq.num_computed = cached
    return n
