"""Fair share between tenants (``Request.tenant``: the client's API token or trusted header):
no tenant holds more than its share of the running slots and KV blocks while another waits.

The rule (max-min fair share), applied by the scheduler on every step that has waiting work
and more than one active tenant (one with running or waiting sequences):

* a tenant's share is ``max_running / active tenants`` slots and ``num_blocks / active
  tenants`` KV blocks;
* a tenant *at or above* either share is *over share*; waiting work is admitted under-share
  tenants first, tenants interleaved (each tenant's first waiting sequence, then each one's
  second, ...; in the policy's order within a tenant), over-share tenants' work after, with
  what is left (the server stays work-conserving);
* when an under-share tenant's next waiting sequence cannot be admitted for want of a slot or
  blocks, running sequences of tenants *above* their share are preempted (by recompute, the
  policy's victim first, from the tenant furthest above its share) until it can;
* preemption to grow a running sequence takes over-share tenants' sequences first, for an
  under-share tenant's sequence;
* a sequence is preempted for a tenant under share only if its own tenant is left with at
  least the use (in shares) that tenant then has. A preemption that merely swapped who is
  over share (two tenants and one running slot; a pool too small for both tenants'
  sequences) would be undone the next step, and with recompute the two tenants would preempt
  each other forever, neither finishing. Where fairness does not decide, the policy does, as
  without fair share: its best running sequence can always grow, so some request always
  finishes.

A tenant alone gets everything; with none waiting the rule costs nothing.
"""

from __future__ import annotations

import collections

from headrace.controlplane.requests.request import Sequence


def tenant(seq: Sequence) -> str:
    return seq.request.tenant


class Shares:
    """Per-tenant use of one step's running slots and blocks."""

    def __init__(self, sched, tenants: set[str]):
        self.sched = sched
        n = len(tenants)
        self.slot_share = sched.max_running / n
        self.block_share = sched.blocks.num_blocks / n
        self.slots: collections.Counter = collections.Counter()
        self.blocks: collections.Counter = collections.Counter()
        for seq in sched.running:
            self.add(seq)

    @classmethod
    def of(cls, sched) -> "Shares | None":
        """The step's shares, or None when the rule has nothing to do (nobody waits, or one
        tenant alone has work)."""
        if not sched.waiting:
            return None
        tenants = {tenant(s) for s in sched.waiting} | {tenant(s) for s in sched.running}
        return cls(sched, tenants) if len(tenants) > 1 else None

    def add(self, seq: Sequence, num_blocks: int | None = None) -> None:
        t = tenant(seq)
        self.slots[t] += 1
        self.blocks[t] += len(self.sched.blocks.block_ids(seq.seq_id)) if num_blocks is None else num_blocks

    def remove(self, seq: Sequence, num_blocks: int) -> None:
        t = tenant(seq)
        self.slots[t] -= 1
        self.blocks[t] -= num_blocks

    def over(self, t: str) -> bool:
        return self.slots[t] >= self.slot_share or self.blocks[t] >= self.block_share

    def excess(self, t: str) -> float:
        """How far above its share a tenant is (> 0: a preemption victim for others)."""
        return self.usage(t) - 1.0

    def usage(self, t: str, slots: int = 0, blocks: int = 0) -> float:
        """A tenant's use in shares (1.0: exactly its share), with ``slots`` and ``blocks``
        more (negative: fewer)."""
        return max((self.slots[t] + slots) / self.slot_share, (self.blocks[t] + blocks) / self.block_share)

    def evens_out(self, victim: Sequence, t: str, slots: int, blocks: int) -> bool:
        """Whether preempting ``victim`` for tenant ``t``, which then holds ``slots`` and
        ``blocks`` more, leaves the victim's tenant with at least ``t``'s use: a preemption
        that only swapped who is over share would be undone the next step, and with
        recompute the two tenants would preempt each other forever."""
        held = len(self.sched.blocks.block_ids(victim.seq_id))
        return self.usage(tenant(victim), -1, -held) >= self.usage(t, slots, blocks)

    def gives_way(self, victim: Sequence, seq: Sequence, blocks: int) -> bool:
        """Whether ``victim`` is preempted so that ``seq`` grows by ``blocks``: for fairness
        when the victim's tenant is over share, ``seq``'s is not and the move ``evens_out``;
        otherwise as the policy ranks them (as without fair share: so the policy's best
        running sequence can always grow, and two prefills that each need a block never wait
        for each other)."""
        v, t = tenant(victim), tenant(seq)
        if v != t and self.over(v) and not self.over(t) and self.evens_out(victim, t, 0, blocks):
            return True
        policy = self.sched.policy
        return policy.victim_key(victim) > policy.victim_key(seq)

    def order(self, ordered: list[Sequence]) -> list[Sequence]:
        """Waiting sequences (in policy order): under-share tenants first, interleaved."""
        nth: collections.Counter = collections.Counter()
        keyed = []
        for i, seq in enumerate(ordered):
            t = tenant(seq)
            keyed.append((self.over(t), nth[t], self.slots[t], i))
            nth[t] += 1
        return [ordered[k[3]] for k in sorted(keyed)]

    def victim_key(self, seq: Sequence) -> tuple:
        """Preemption order (higher first): over-share tenants' sequences, then the policy's."""
        return (self.over(tenant(seq)), self.sched.policy.victim_key(seq))

    def make_room(self, ordered: list[Sequence], scheduled: set[int]) -> None:
        """Preempts above-share tenants' running work until every under-share tenant's waiting
        sequence (``ordered``: this step's admission order) has a slot and its first chunk's
        blocks."""
        sched = self.sched
        blocks = sched.blocks
        free_slots = sched.max_running - len(sched.running)
        free_blocks = blocks.num_free - sched.watermark_blocks
        for seq in ordered:
            t = tenant(seq)
            if self.over(t):
                break   # over-share work comes last in ``ordered``
            if seq.num_inflight:
                continue
            need = blocks.blocks_for(min(seq.num_tokens, sched.max_batched_tokens))
            while free_slots < 1 or free_blocks < need:
                victims = [r for r in sched.running if r.seq_id not in scheduled
                           and self.excess(tenant(r)) > 0 and tenant(r) != t
                           and self.evens_out(r, t, 1, need)]
                if not victims:
                    return
                worst = max(self.excess(tenant(r)) for r in victims)
                victim = max((r for r in victims if self.excess(tenant(r)) == worst),
                             key=sched.policy.victim_key)
                held = len(blocks.block_ids(victim.seq_id))
                sched.preempt(victim)
                self.remove(victim, held)
                free_slots += 1
                free_blocks += held
            free_slots -= 1
            free_blocks -= need
            self.add(seq, need)
