"""The prefill part of a scheduled step: after the running decodes took their tokens, the running
prefills and the waiting sequences get their chunks by
``headrace.controlplane.scheduling.chunking``'s rules (the prefill budget, short prompts before long
ones, the fair split, the per-prefill cap). A running prefill grows its blocks (preempting the
policy's victims if need be, as a decode does); a waiting sequence is admitted (``Scheduler.admit``)
while slots are free, in strict order: once one does not fit the blocks, the sequences after it wait
too. A step that had to preempt admits nobody: the victims would be readmitted at once and throw
their KV away again (thrashing) while running work still needs blocks. With a host KV tier, a
waiting sequence whose admission loads host-tier blocks may be deferred until they land
(``headrace.controlplane.kv.prefetch``), and the first few sequences left waiting start their loads."""

from __future__ import annotations

from headrace.controlplane.requests.request import Sequence, Status
from headrace.controlplane.scheduling.step import NewSeq, ScheduledStep


def to_compute(seq: Sequence) -> int:
    """Tokens a sequence has left to compute (its prompt left to prefill, or a decode's one)."""
    return seq.num_total - seq.num_computed


def fill(sched, step: ScheduledStep, running: list[Sequence], waiting: list[Sequence],
         budget: int, decoding: bool, preemptions_before: int, scheduled: set[int],
         victim_key, add_spec) -> None:
    """Adds the prefill chunks to ``step``: ``running`` prefills and ``waiting`` sequences,
    each list in service order, share ``budget`` (what the decodes left; ``decoding``: the
    step carries some). ``add_spec``: the step's speculative-positions column, when it has
    one (a prefill gets none)."""
    chunking, bs, blocks = sched.chunking, sched.blocks.block_size, sched.blocks
    left = chunking.prefill_budget(budget, decoding)
    slots = sched.max_running - len(sched.running) if sched.num_preemptions == preemptions_before else 0
    now, prefetch = sched.clock(), sched.prefetch
    order = []   # the candidates: every running prefill, as many admissible ones as slots are free
    for seq in chunking.order(running + waiting, to_compute):
        if seq.status is Status.RUNNING:
            order.append(seq)
        elif slots > 0 and not seq.num_inflight and not prefetch.loading(seq, now) and \
                sched.lora_ready(seq):
            # (not: preempted with a token in flight, its host-tier KV still landing, or its
            # LoRA adapter in no slot)
            order.append(seq)
            slots -= 1
    head = chunking.max_num_partial_prefills
    shares = chunking.shares([to_compute(s) for s in order[:head]], left)
    spare, admitting, cols = 0, True, step.running
    for i, seq in enumerate(order):
        if left < 1:
            break
        share = shares[i] if i < head else left   # past the fair split: what the first left
        grant = chunking.cap(min(share + spare, left))
        if grant < 1:
            continue
        used = 0
        if seq.status is Status.RUNNING and seq.seq_id not in scheduled:   # its next chunk
            start = seq.num_computed
            n, new_blocks = min(to_compute(seq), grant), ()
            if blocks.needs_blocks(seq.seq_id, start + n):
                n, new_blocks = sched.grow(seq, start, n, scheduled, victim_key) or (0, ())
                cols.new_block_ids.extend(new_blocks)
            if n > 0:
                if (start + n) // bs > start // bs:   # a block fills up: publish it
                    sched.register(seq, start + n)
                if add_spec is not None:
                    add_spec(0)
                cols.seqs.append(seq)
                cols.num_tokens.append(n)
                cols.new_block_counts.append(len(new_blocks))
                scheduled.add(seq.seq_id)
                used = n
        elif (seq.status is Status.WAITING and admitting and len(sched.running) < sched.max_running
              and sched.num_preemptions == preemptions_before):
            used = sched.admit(seq, grant)
            if used is None:   # its host-tier KV loads from this step on, computed once landed
                used = 0
            elif used:
                step.new.append(NewSeq(seq, used, blocks.block_ids(seq.seq_id)))
                scheduled.add(seq.seq_id)
            else:
                admitting = False   # strict order: the next in line waits for blocks
        spare = max(0, share + spare - used)
        left -= used
    if sched.num_preemptions == preemptions_before:   # the loads of those left waiting start now
        rest = [s for s in waiting if s.status is Status.WAITING and s.seq_id not in scheduled]
        if rest:
            prefetch.look_ahead(rest, sched.watermark_blocks)
