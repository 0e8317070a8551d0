"""Iteration-level scheduler: every step, which sequences run and how many tokens each
computes, within a token budget and a cap on running sequences.

Order of service each step: running decodes (``headrace.controlplane.scheduling.decode_phase``),
then the prefill chunks of running prefills and of waiting sequences admitted in policy order
(``policy``), sized by ``headrace.controlplane.scheduling.chunking`` (a budget for prompt tokens in
a step with decodes, short prompts before long ones, a fair split; applied by
``headrace.controlplane.scheduling.prefill_phase``), so a long prompt is spread over steps and never
blocks short ones. Admission leaves a watermark of free blocks. When a running sequence needs blocks
that are not there, the policy's victims (never one already scheduled in this step) are preempted by
recompute: their blocks are freed and they wait again with their generated tokens; the sequence
preempts itself when it is the worst. A step that preempted admits nobody (no readmission thrash).
Parallel samples fork from their parent once its prompt is computed, sharing its blocks and copying
the block they will write into (copy on write). With ``fair_share``, tenants share the running slots
and blocks while more than one has work (``headrace.controlplane.scheduling.fairness``: the order of
admission, preemption for an under-share tenant). Speculating steps give decodes k draft positions,
budgeted as tokens, with blocks taken only when free (never by preempting); ``verified`` registers
the accepted drafts' full blocks (so rejected K/V is never shared) and gives the rejected positions'
blocks back. With a host KV tier and ``preemption_mode="swap"`` a victim's KV is copied to the host
tier (``BlockManager.swap_out``) and copied back when it is resumed
(``headrace.controlplane.scheduling.admission`` takes an admitted sequence's blocks), instead of
recomputed; host-tier prefix hits are loaded where ``tier_cost`` finds that cheaper than recomputing
them; the step carries the host-tier copies its decisions need (``ScheduledStep.swap_out/swap_in``).
While other sequences run, a sequence that loads host-tier blocks is computed only once its loads
should have landed (``headrace.controlplane.kv.prefetch``): it waits meanwhile, holding them.
"""

from __future__ import annotations

import time

from headrace.controlplane.scheduling import decode_phase, fairness, prefill_phase
from headrace.controlplane.scheduling.chunking import Chunking
from headrace.controlplane.scheduling.forks import Forks
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.scheduling.policy import Policy
from headrace.controlplane.kv.prefetch import Prefetch
from headrace.controlplane.requests.request import Sequence, Status
from headrace.controlplane.engine.speculation import Speculation
from headrace.controlplane.scheduling.step import ScheduledStep
from headrace.controlplane.kv.tier_cost import TierCost

PREEMPTION_MODES = ("recompute", "swap")
TIME_RECHECK_S = 0.01   # how often waiting work is looked at again while only time can let it in


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_batched_tokens: int,
                 policy: Policy | None = None, watermark: float = 0.01,
                 clock=time.monotonic, fair_share: bool = True,
                 speculation: Speculation | None = None, preemption_mode: str = "recompute",
                 tier_cost: TierCost | None = None, chunking: Chunking | None = None):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode {preemption_mode!r}: choose from {PREEMPTION_MODES}")
        self.preemption_mode = preemption_mode
        self.tier_cost = tier_cost   # None: every host-tier prefix hit is loaded
        self.blocks = blocks
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.policy = policy or Policy()
        self.chunking = chunking or Chunking()
        self.watermark_blocks = int(watermark * blocks.num_blocks)
        self.clock = clock
        self.fair_share = fair_share
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.forks = Forks()   # n > 1: children waiting for their parent's prompt, then forked
        self._forget: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.speculation = speculation
        self._truncations: list[tuple[int, int]] = []   # (seq id, blocks) for the workers
        self.prefetch = Prefetch(blocks, tier_cost, clock)   # host-tier loads ahead of compute
        self._shares: fairness.Shares | None = None   # the step's tenants' shares (fair_share)
        self.lora = None   # headrace.controlplane.lora.registry.LoraAdapters when the workers serve LoRA adapters

    # -- membership ---------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        """Queues a request's sequences: the first computes the prompt, the others fork. A
        request that resumes with generated tokens (moved from a lost engine core) queues
        every sample: each recomputes its own tokens."""
        now = self.clock()
        if any(s.output_token_ids for s in seqs):
            for seq in seqs:
                seq.status, seq.waiting_since = Status.WAITING, now
                self.waiting.append(seq)
            return
        parent, *children = seqs
        parent.status, parent.waiting_since = Status.WAITING, now
        self.waiting.append(parent)
        self.forks.defer(parent, children)

    def reconfigure(self, *, policy: Policy | None = None, max_running: int | None = None,
                    max_batched_tokens: int | None = None) -> None:
        """Live changes (None keeps a value); they take effect from the next step."""
        if max_running is not None and max_running < 1:
            raise ValueError("max_running must be >= 1")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        self.policy = self.policy if policy is None else policy
        self.max_running = self.max_running if max_running is None else max_running
        self.max_batched_tokens = self.max_batched_tokens if max_batched_tokens is None else max_batched_tokens

    @property
    def num_queued(self) -> int:
        """Sequences not yet admitted: waiting ones and parallel samples waiting for their
        parent's prompt (what ``--max-queued`` bounds; a request of n samples counts n)."""
        return len(self.waiting) + self.forks.num_pending

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def retry_after(self) -> float | None:
        """After a step that scheduled nothing: seconds after which time alone may change that
        (the policy ages waiting work or bounds its queue delay), or None when only an event
        can (a request added, finished or aborted; a new cap or budget)."""
        p = self.policy
        landing = self.prefetch.retry_after(self.clock())   # a deferred sequence's KV lands
        if not self.waiting or (not p.aging and p.max_queue_delay is None):
            return landing
        return TIME_RECHECK_S if landing is None else min(landing, TIME_RECHECK_S)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        if self.speculation is not None:
            self.speculation.forget(seq.seq_id)
            self._truncations = [t for t in self._truncations if t[0] != seq.seq_id]
        self.forks.discard(seq)
        if seq.on_worker:
            self._forget.append(seq.seq_id)
            seq.on_worker = False

    def finish(self, seq: Sequence, reason: int) -> None:
        """Retires a sequence (finished, aborted or failed) and frees its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        for child in self.forks.orphans(seq):
            self._enqueue(child)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.prefetch.forget(seq)
        self._release(seq)
        self.blocks.drop_swapped(seq.seq_id)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status, seq.num_computed, seq.waiting_since = Status.WAITING, 0, self.clock()
        self.waiting.append(seq)

    def reset(self) -> None:
        """The workers lost their state (a data plane died, a reload failed): every running
        sequence waits again to be recomputed from its prompt and the tokens it already has;
        tokens that were in flight are lost and computed again; the prefix cache forgets every
        block (their KV contents are gone). Nothing needs forgetting on a fresh stream."""
        running, self.running = self.running, []
        for seq in running:
            self.blocks.free(seq.seq_id)
            seq.on_worker = False
            seq.num_inflight = 0
            self._enqueue(seq)
        for seq in self.waiting:
            seq.num_inflight = 0
            seq.num_computed = 0   # a swapped sequence's host blocks are gone too
        self._forget.clear()
        self._copies.clear()
        self.forks.clear_unsent()
        self._truncations.clear()
        self.prefetch.reset()
        self.blocks.reset_cache()
        if self.lora is not None:   # their slots and host caches are gone too
            self.lora.reset()

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        kept = seq.num_computed
        swapped = self.preemption_mode == "swap" and self.blocks.swap_out(seq.seq_id, kept)
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        if swapped:   # its KV waits in the host tier
            seq.num_computed = kept

    # -- one step -----------------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int], key) -> bool:
        """Preempts victims (highest ``key`` first) until ``seq`` can cover ``num_tokens``;
        False if it cannot."""
        while not self.blocks.can_grow(seq.seq_id, num_tokens):
            if self.prefetch.release():   # a deferred sequence's blocks first
                continue
            shares, more = self._shares, self.blocks.blocks_needed(seq.seq_id, num_tokens)
            victims = [r for r in self.running if r.seq_id not in scheduled and r is not seq and (
                key(r) > key(seq) if shares is None else shares.gives_way(r, seq, more))]
            if not victims:
                return False
            victim = max(victims, key=key)
            if shares is not None:
                shares.remove(victim, len(self.blocks.block_ids(victim.seq_id)))
            self.preempt(victim)
        return True

    def register(self, seq: Sequence, end: int) -> None:
        self.blocks.register(seq.seq_id, lambda: seq.token_ids, end, seq.cache_root)

    def may_speculate(self) -> bool:
        """Whether the next step should speculate (then nothing else may be in flight)."""
        return self.speculation is not None and self.speculation.active(self.running)

    def schedule(self, speculate: bool = False) -> ScheduledStep:
        """The next step; ``speculate``: its decodes may get speculative positions (the
        engine asks only with nothing in flight: the sequences' tokens are all known)."""
        now = self.clock()
        step = ScheduledStep()
        budget = self.max_batched_tokens
        if self.lora is not None:
            self.lora.slots.begin_step()
        preemptions_before = self.num_preemptions
        scheduled: set[int] = set()
        budget = self.forks.send(step, self.blocks, budget, scheduled)
        shares = fairness.Shares.of(self) if self.fair_share else None
        if shares is not None:   # under-share tenants that wait get room first
            shares.make_room(shares.order(self.policy.order_waiting(self.waiting, now)), scheduled)
            shares = fairness.Shares.of(self)
        victim_key = self.policy.victim_key if shares is None else shares.victim_key
        self._shares = shares   # the step's, for preemptions between tenants (``_make_room``)
        unsent = {s.seq_id for s in self.forks.unsent}
        skip = scheduled | unsent
        running = step.running
        add_spec = running.num_spec.append if speculate and self.speculation is not None else None
        budget, prefills = decode_phase.fill(self, step, budget, scheduled, skip, victim_key, add_spec, now)
        step.has_decodes = bool(running.seqs or step.new)   # (so far: decodes, forked samples)
        waiting = self.policy.order_waiting(self.waiting, now)
        prefill_phase.fill(self, step, prefills, waiting if shares is None else shares.order(waiting),
                           budget, step.has_decodes, preemptions_before, scheduled, victim_key, add_spec)
        step.num_preempted = self.num_preemptions - preemptions_before
        lora_ops = self.lora is not None and self.lora.slots.pending
        if not step.empty or self.blocks.copies_pending or lora_ops:   # an empty step is not sent: what
            # workers must drop waits for the next (one with only loads to start is sent)
            step.finished_seq_ids, self._forget = self._forget, []
            step.copies, self._copies = self._copies, []
            step.truncations, self._truncations = self._truncations, []
            step.swap_out, step.swap_in = self.blocks.take_ops()
            if lora_ops:
                step.lora_loads, step.lora_drops = self.lora.slots.take_ops()
        return step

    def lora_ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be admitted as far as its LoRA adapter goes: none, or in a
        device slot now (``headrace.controlplane.lora.registry``; a running sequence's slot is never taken)."""
        return seq.lora is None or (self.lora is not None and self.lora.admissible(seq.lora, self.running))

    def grow(self, seq: Sequence, start: int, n: int, scheduled: set[int], victim_key):
        """Blocks for ``seq``'s next ``n`` tokens from ``start``, preempting victims for them:
        (tokens it may compute, new block ids), or None when it cannot run in this step (a
        decode that cannot grow gives its blocks back; a prefill computes what fits)."""
        if not self._make_room(seq, start + n, scheduled, victim_key):
            if not seq.in_prefill:
                self.preempt(seq)
                return None
            n = self.blocks.max_tokens_growable(seq.seq_id) - start
            if n < 1:
                return None
        return n, self.blocks.grow(seq.seq_id, start + n)

    def admit(self, seq: Sequence, budget: int) -> int | None:
        """Admits ``seq`` with up to ``budget`` tokens: the tokens scheduled, 0 when its
        blocks do not fit, None when its host-tier loads were started and its compute waits
        for them (``headrace.controlplane.kv.prefetch``)."""
        busy = bool(self.running)   # loads can overlap other sequences' steps
        n = self.prefetch.admit(seq, budget, self.watermark_blocks if busy else 0,
                                busy and self.prefetch.held < self.max_running)
        while n == 0 and not busy and self.prefetch.release(keep=seq):
            n = self.prefetch.admit(seq, budget, 0, False)   # nothing runs to free blocks
        if n:
            self.waiting.remove(seq)
            self.register(seq, seq.num_computed + n)
            seq.status, seq.on_worker = Status.RUNNING, True
            self.running.append(seq)
        return n

    def verified(self, seq: Sequence, given: int, drafts: int, accepted: int) -> None:
        """A verify's result for ``seq`` (its tokens appended): ``accepted`` drafts' KV is
        valid, full blocks up to there are published, the blocks beyond the next token's go
        back (the workers cut their table with the next step)."""
        if self.speculation is not None:
            self.speculation.observe(seq, given, drafts, accepted)
        if seq.status is not Status.RUNNING:
            return
        seq.num_computed += accepted
        self.register(seq, seq.num_computed)
        kept = self.blocks.truncate(seq.seq_id, seq.num_total)
        if kept is not None:
            self._truncations.append((seq.seq_id, kept))

    def after_step(self, step: ScheduledStep) -> None:
        """Called once the step is sent: advances every sequence it computes, counts the token
        each sampling sequence will get (``num_inflight``, until its result arrives), and forks
        the parallel samples of parents whose prompt is now computed."""
        for seq, n in step.scheduled():
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed += n
            if seq.num_computed == seq.num_total:   # computes its last token: samples
                for child in self.forks.due(seq):   # n > 1: its prompt is computed
                    if len(self.running) >= self.max_running or self.blocks.num_free < 1:
                        self._enqueue(child)
                    else:
                        self._copies.append(self.forks.fork(self.blocks, seq, child))
                        self.running.append(child)
                seq.num_inflight += 1
