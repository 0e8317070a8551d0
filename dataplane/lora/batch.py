"""Which adapter slot each token of a step uses, as the LoRA kernels read it (``kernels.LoraMeta``:
the tokens grouped by slot, and those groups cut into the kernels' blocks), and whether the
step runs the LoRA kernels at all.

Host side (``plan``): from the step's per-token slots (``InputBatch.prepare``: -1 for a token
of no adapter, which is every token of a worker whose sequences use none) one int32 array
``[blocks of 16 tokens | blocks of 64 | order]`` (each block list a fixed number of
(slot, start, tokens) rows, the unused ones zero; ``order`` the tokens with a slot, grouped),
uploaded with the step's other inputs, and the same groups as host tuples (the torch
reference's ``segments``). A step where no token has an adapter has no plan: it runs exactly as
without LoRA (eager: the layers skip the kernels; CUDA graphs: the variant captured without
them).

Device side (``LoraBatch``): one static int32 buffer the layers' kernels read through
``meta`` (its views never change, so CUDA graphs captured over them replay any step's
groups); ``begin`` copies a step's uploaded array into it (one copy) and sets ``active``;
the graphs pick their variant by ``active`` (``headrace.dataplane.lora.graphs``).
"""

from __future__ import annotations

import contextlib
import typing

import numpy as np
import torch

from headrace.dataplane.input_batch import BatchError
from headrace.kernels import LoraMeta
from headrace.kernels.reference_lora import BLOCK_SIZES, block_rows, max_blocks


class Plan(typing.NamedTuple):
    array: np.ndarray        # int32 [blocks per BLOCK_SIZES | order]
    segments: tuple          # ((slot, start, count), ...) of the slots with tokens
    slots: tuple[int, ...]   # those slots


def layout(num_slots: int, max_tokens: int) -> list[int]:
    """The rows of each block list (one per ``BLOCK_SIZES``) in a worker's buffer."""
    return [max_blocks(max_tokens, num_slots, size) for size in BLOCK_SIZES]


def plan(token_slots: np.ndarray | None, num_slots: int, max_tokens: int) -> Plan | None:
    """The step's groups (None when no token has an adapter); ``max_tokens``: the worker's
    largest step (the block lists' fixed length)."""
    if token_slots is None:
        return None
    used = token_slots >= 0
    if not used.any():
        return None
    order = np.argsort(token_slots, kind="stable")[int((~used).sum()):]
    counts = np.bincount(token_slots[used], minlength=num_slots)
    if len(counts) > num_slots:
        raise BatchError(f"a sequence uses LoRA slot {len(counts)}; the worker has {num_slots}")
    if len(token_slots) > max_tokens:
        raise BatchError(f"a step of {len(token_slots)} tokens; the worker holds {max_tokens}")
    starts = np.cumsum(counts) - counts
    lists = [block_rows(counts, size, rows).ravel()
             for size, rows in zip(BLOCK_SIZES, layout(num_slots, max_tokens))]
    array = np.concatenate((*lists, order.astype(np.int32))).astype(np.int32)
    slots = tuple(int(s) for s in np.flatnonzero(counts))
    return Plan(array, tuple((s, int(starts[s]), int(counts[s])) for s in slots), slots)


class LoraBatch:
    """The step's groups on the device, as every LoRA layer reads them."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device, slots=None):
        self.num_slots, self.max_tokens = num_slots, max_tokens
        rows = layout(num_slots, max_tokens)
        self.head = 3 * sum(rows)   # the block lists' elements, before ``order``
        self.buffer = torch.zeros(self.head + max_tokens, dtype=torch.int32, device=device)
        self.slots = slots   # headrace.dataplane.lora.slots.LoraSlots: its pending loads are waited for
        self.active = False
        lists, offset = [], 0
        for n in rows:
            lists.append(self.buffer[offset:offset + 3 * n].view(n, 3))
            offset += 3 * n
        self.meta = LoraMeta(self.buffer[self.head:], tuple(lists), ())

    def begin(self, step: Plan | None, array: torch.Tensor | None) -> None:
        """Sets the step's groups: ``array`` is ``step.array`` uploaded (None: no adapter)."""
        if step is None:
            self.active = False
            return
        if self.slots is not None:
            self.slots.wait_for(step.slots)
        self.buffer[:array.shape[0]].copy_(array)
        self.meta = self.meta._replace(segments=step.segments)
        self.active = True

    @contextlib.contextmanager
    def capturing(self, active: bool):
        """The layers run (``True``) or skip the LoRA kernels while a graph variant is
        captured; every block list is empty (the kernels' programs exit)."""
        was = self.active
        self.buffer[:self.head].zero_()
        self.active = active
        try:
            yield
        finally:
            self.active = was


def apply_loads(batch: LoraBatch | None, step, num_lora_rows: int) -> None:
    """A step's ``lora_loads`` into the worker's slots (BatchError for LoRA sent to a worker
    without ``--enable-lora``)."""
    if batch is None:
        if step.lora_loads or num_lora_rows or step.lora_drops:
            raise BatchError("LoRA adapters sent to a worker started without --enable-lora")
        return
    for load in step.lora_loads:
        batch.slots.load(load.slot - 1, load.adapter_id)
    if step.lora_drops:
        batch.slots.drop(step.lora_drops)
