"""What one scheduled step holds, as typed records (modelled on vLLM V1's
``NewRequestData`` / ``CachedRequestData`` / ``SchedulerOutput``): the scheduler fills them,
the step codec turns them into the wire message, telemetry and the engine read them."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from headrace.controlplane.requests.request import Sequence


@dataclasses.dataclass(slots=True)
class NewSeq:
    """A sequence the workers do not hold yet (admitted, resumed after a preemption, or a
    parallel sample just forked): they build their mirror of it from this record."""
    seq: Sequence                # carries the prompt, the tokens so far and the sampling options
    num_tokens: int              # tokens it computes in this step, from ``seq.num_computed``
    block_ids: tuple[int, ...]   # its whole block table as of this step


@dataclasses.dataclass(slots=True)
class RunningSeqs:
    """The sequences the workers already hold that run in this step, column by column like
    the wire message (vLLM's ``CachedRequestData``): no record per sequence and step."""
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    num_tokens: list[int] = dataclasses.field(default_factory=list)        # tokens each computes
    new_block_counts: list[int] = dataclasses.field(default_factory=list)  # blocks each table gained
    new_block_ids: list[int] = dataclasses.field(default_factory=list)     # those blocks, in order
    num_spec: list[int] = dataclasses.field(default_factory=list)   # speculative positions each
                                                                    # (empty: a step without)


@dataclasses.dataclass(slots=True)
class ScheduledStep:
    """One step's decisions (vLLM's ``SchedulerOutput``)."""
    new: list[NewSeq] = dataclasses.field(default_factory=list)             # first scheduled now
    running: RunningSeqs = dataclasses.field(default_factory=RunningSeqs)  # held by the workers
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)  # the workers drop these
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) blocks
    num_preempted: int = 0   # sequences this step preempted (they wait again)
    truncations: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (seq, blocks)
    # host KV tier copies, run before the step's other copies and its forward, out first
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (host, device)
    has_decodes: bool = False   # some sequence computes its next token (not only prompt chunks)
    # LoRA: adapters copied into device slots (slot, host-cache id), then host copies dropped
    lora_loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lora_drops: list[int] = dataclasses.field(default_factory=list)

    @property
    def speculative(self) -> bool:
        """Some sequence verifies drafts in this step (it runs alone: flushed at once)."""
        return any(self.running.num_spec)

    @property
    def empty(self) -> bool:
        """Nothing to compute and no host-tier copy to start: not sent."""
        return not self.new and not self.running.seqs and not self.swap_in and not self.swap_out \
            and not self.lora_loads and not self.lora_drops

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.new) + sum(self.running.num_tokens)

    def scheduled(self) -> Iterator[tuple[Sequence, int]]:
        """(sequence, tokens it computes) of every sequence in the step, new ones first."""
        for r in self.new:
            yield r.seq, r.num_tokens
        yield from zip(self.running.seqs, self.running.num_tokens)
