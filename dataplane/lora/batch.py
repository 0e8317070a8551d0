"""Which adapter slot each token of a step uses, as the LoRA kernels read it (``kernels.LoraMeta``:
the tokens grouped by slot, the count and start of each slot's group), and whether the step
runs the LoRA kernels at all.

Host side (``plan``): from the step's per-token slots (``InputBatch.prepare``: -1 for a token
of no adapter, which is every token of a worker whose sequences use none) one int32 array
``[counts (slots), starts (slots), order (tokens with a slot)]``, uploaded with the step's other
inputs, and the same groups as host tuples (the torch reference's ``segments``). A step where
no token has an adapter has no plan: it runs exactly as without LoRA (eager: the layers skip
the kernels; CUDA graphs: the variant captured without them).

Device side (``LoraBatch``): one static int32 buffer the layers' kernels read through
``meta`` (its views never change, so CUDA graphs captured over them replay any step's
groups); ``begin`` copies a step's uploaded array into it (one copy) and sets ``active``;
the graphs pick their variant by ``active`` (``dataplane.lora.graphs``).
"""

from __future__ import annotations

import contextlib
import typing

import numpy as np
import torch

from dataplane.input_batch import BatchError
from kernels import LoraMeta


class Plan(typing.NamedTuple):
    array: np.ndarray        # int32 [counts | starts | order]
    segments: tuple          # ((slot, start, count), ...) of the slots with tokens
    slots: tuple[int, ...]   # those slots


def plan(token_slots: np.ndarray | None, num_slots: int) -> Plan | None:
    """The step's groups (None when no token has an adapter)."""
    if token_slots is None:
        return None
    used = token_slots >= 0
    if not used.any():
        return None
    order = np.argsort(token_slots, kind="stable")[int((~used).sum()):]
    counts = np.bincount(token_slots[used], minlength=num_slots)
    if len(counts) > num_slots:
        raise BatchError(f"a sequence uses LoRA slot {len(counts)}; the worker has {num_slots}")
    starts = np.cumsum(counts) - counts
    array = np.concatenate((counts, starts, order)).astype(np.int32)
    slots = tuple(int(s) for s in np.flatnonzero(counts))
    return Plan(array, tuple((s, int(starts[s]), int(counts[s])) for s in slots), slots)


class LoraBatch:
    """The step's groups on the device, as every LoRA layer reads them."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device, slots=None):
        self.num_slots, self.max_tokens = num_slots, max_tokens
        self.buffer = torch.zeros(2 * num_slots + max_tokens, dtype=torch.int32, device=device)
        self.slots = slots   # dataplane.lora.slots.LoraSlots: its pending loads are waited for
        self.active = False
        self.meta = LoraMeta(self.buffer[2 * num_slots:], self.buffer[:num_slots],
                             self.buffer[num_slots:2 * num_slots], ())

    def begin(self, step: Plan | None, array: torch.Tensor | None) -> None:
        """Sets the step's groups: ``array`` is ``step.array`` uploaded (None: no adapter)."""
        if step is None:
            self.active = False
            return
        n = array.shape[0]
        if n > self.buffer.shape[0]:
            raise BatchError(f"a step of {n - 2 * self.num_slots} LoRA tokens; the worker holds "
                             f"{self.max_tokens}")
        if self.slots is not None:
            self.slots.wait_for(step.slots)
        self.buffer[:n].copy_(array)
        self.meta = self.meta._replace(segments=step.segments)
        self.active = True

    @contextlib.contextmanager
    def capturing(self, active: bool):
        """The layers run (``True``) or skip the LoRA kernels while a graph variant is
        captured; every slot's group is empty (the kernels' programs exit)."""
        was = self.active
        self.buffer[:2 * self.num_slots].zero_()
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
