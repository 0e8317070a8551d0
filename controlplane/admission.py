"""How a waiting sequence gets the blocks of its next tokens when the scheduler admits it: its
prompt's cached prefix adopted from either KV tier (``BlockManager.match_prefix``), or, after a
swap preemption, its own KV copied back from the host tier. The scheduler decides who is
admitted and in what order; this decides whether the blocks fit and takes them.
"""

from __future__ import annotations

from controlplane.block_manager import BlockManager
from controlplane.request import Sequence


def admit(blocks: BlockManager, seq: Sequence, budget: int, reserve: int) -> int:
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
    hits = blocks.match_prefix(seq.token_ids)
    cached = blocks.cached_tokens(hits)
    n = min(seq.num_tokens - cached, budget)
    if blocks.cost(hits, cached + n) + reserve > blocks.num_free:
        return 0
    blocks.adopt(seq.seq_id, hits, seq.num_tokens)
    blocks.grow(seq.seq_id, cached + n)
    if not seq.output_token_ids and seq.num_preemptions == 0:
        seq.num_cached_prompt_tokens = cached
    seq.num_computed = cached
    return n
