"""How a waiting sequence gets the blocks of its next tokens when the scheduler admits it: its
prompt's cached prefix adopted from either KV tier (``BlockManager.match_prefix``), or, after a swap
preemption, its own KV copied back from the host tier. The scheduler decides who is admitted and in
what order; this decides whether the blocks fit and takes them. Host-tier hits are adopted only as
far as ``headrace.controlplane.kv.tier_cost`` finds loading them cheaper than recomputing them
(``cost``; None: all of them); the rest of the prompt is computed.

With ``defer_loads`` a sequence whose admission loads host-tier blocks takes only the blocks of what
it loads (their copies go out with the step being built) and is computed in a later step, once they
have landed (``headrace.controlplane.kv.prefetch``); it then comes back here holding its table, and
takes the blocks of its next tokens.
"""

from __future__ import annotations

from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.requests.request import Sequence
from headrace.controlplane.kv.tier_cost import TierCost


def admit(blocks: BlockManager, seq: Sequence, budget: int, reserve: int,
          cost: TierCost | None = None, defer_loads: bool = False) -> int | None:
    """Takes ``seq``'s blocks for its next tokens, at most ``budget``, leaving ``reserve``
    blocks free; sets ``num_computed`` to what its KV already holds (or will, once loaded).
    Returns how many tokens the step computes for it, 0 when its blocks do not fit (nothing
    taken), None when ``defer_loads`` deferred it: it holds the blocks it loads, nothing is
    computed yet."""
    sid = seq.seq_id
    if blocks.block_ids(sid):   # deferred before: its KV is loaded (or landing) into its table
        start = seq.num_computed
        n = min(seq.num_tokens - start, budget)
        if n < 1 or blocks.blocks_needed(sid, start + n) + reserve > blocks.num_free:
            return 0
        blocks.grow(sid, start + n)
        return n
    if blocks.is_swapped(sid):   # its KV waits in the host tier: copied back
        start = seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
        n = min(seq.num_tokens - start, budget)
        end = start if defer_loads else start + n
        if (n < 1 and not defer_loads) or blocks.swap_in_cost(sid, end) + reserve > blocks.num_free:
            return 0
        blocks.swap_in(sid, end)
        return None if defer_loads else n
    found = blocks.match_prefix(seq.token_ids, seq.cache_root)
    hits = found if cost is None or blocks.host is None else found[:cost.cut(found)]
    cached = blocks.cached_tokens(hits)
    n = min(seq.num_tokens - cached, budget)
    defer = defer_loads and any(b < 0 for b in hits)
    end = cached if defer else cached + n
    if (n < 1 and not defer) or blocks.cost(hits, end) + reserve > blocks.num_free:
        return 0
    blocks.adopt(sid, hits, seq.num_tokens)
    if len(hits) < len(found):
        cost.skipped(found[len(hits):])
    blocks.grow(sid, end)
    if not seq.output_token_ids and seq.num_preemptions == 0:
        seq.num_cached_prompt_tokens = cached
    seq.num_computed = cached
    return None if defer else n
