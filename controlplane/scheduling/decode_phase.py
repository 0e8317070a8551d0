"""The decode part of a scheduled step, served first: every running sequence with one token left to
compute gets it (in the policy's order when not all of them fit the budget or the free blocks; in
the running order otherwise, the common steady state, which costs no sort). A decode whose next
token starts a block grows its table, preempting the policy's victims if need be
(``Scheduler.grow``); a block it fills is published to the prefix cache. In a speculating step a
decode also gets up to k draft positions, budgeted as tokens, their blocks taken only where free
(``Speculation.grant``). Running sequences with more than one token left are prefills: they are
handed back in service order for ``headrace.controlplane.scheduling.prefill_phase``."""

from __future__ import annotations

from headrace.controlplane.requests.request import Sequence, Status
from headrace.controlplane.scheduling.step import ScheduledStep


def fill(sched, step: ScheduledStep, budget: int, scheduled: set[int], skip: set[int],
         victim_key, add_spec, now: float) -> tuple[int, list[Sequence]]:
    """Adds the decodes to ``step``'s running columns (``skip``: sequences not to schedule);
    returns the budget left and the running prefills, in service order. ``add_spec``: the
    step's speculative-positions column, when it speculates."""
    blocks, bs = sched.blocks, sched.blocks.block_size
    needs_blocks = blocks.needs_blocks
    running = step.running   # its columns, appended to without a call per sequence:
    add_seq, add_n = running.seqs.append, running.num_tokens.append
    add_count = running.new_block_counts.append
    spec = sched.speculation
    order = [s for s in sched.running if s.seq_id not in skip and s.may_sample_more]
    if not fits_unordered(order, budget, blocks.num_free):
        order.sort(key=lambda s: (s.in_prefill, sched.policy.rank(s, now)))
    prefills = []
    for seq in order:
        if budget < 1:
            break
        if seq.status is not Status.RUNNING:
            continue   # preempted for a better-ranked sequence in this loop
        start = seq.num_computed
        left = seq.num_total - start
        if left != 1:
            if left > 1:
                prefills.append(seq)
            continue   # (none left: its last token is still in flight)
        new_blocks: list[int] | tuple = ()
        if needs_blocks(seq.seq_id, start + 1):   # the common decode does not
            grown = sched.grow(seq, start, 1, scheduled, victim_key)
            if grown is None:
                continue
            new_blocks = grown[1]
            running.new_block_ids.extend(new_blocks)
        if (start + 1) // bs > start // bs:   # a block fills up: publish it
            sched.register(seq, start + 1)
        k = 0
        if spec is not None:
            k, more = spec.grant(seq, blocks, budget, add_spec is not None)
            if more:
                running.new_block_ids.extend(more)
                new_blocks = list(new_blocks) + more
        if add_spec is not None:
            add_spec(max(0, k))
        add_seq(seq)
        add_n(1)
        add_count(len(new_blocks))
        scheduled.add(seq.seq_id)
        budget -= 1 + max(0, k)
    return budget, prefills


def fits_unordered(order: list[Sequence], budget: int, num_free: int) -> bool:
    """Whether every candidate is a decode and all of them fit the token budget and the free
    blocks: then nobody is left out or preempted and the service order is moot."""
    if len(order) > budget or len(order) > num_free:
        return False
    return not any(s.num_total - s.num_computed > 1 for s in order)
