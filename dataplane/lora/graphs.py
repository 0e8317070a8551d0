"""CUDA graphs of a worker serving LoRA adapters: every graph is captured twice, with the LoRA
kernels of its projections and without them, and a step replays the variant its batch needs
(``LoraBatch.active``: some token has an adapter). So a step of the base model alone replays
exactly the graphs of a worker without LoRA (no empty launches), and a step with adapters
reads their groups from the ``LoraBatch``'s static buffer. A model without LoRA has one variant.
"""

from __future__ import annotations

import contextlib


def batch_of(model):
    """The model's ``LoraBatch`` (None without LoRA); the graphs keep it, read once."""
    return getattr(model, "lora", None)


def variants(batch) -> tuple[bool, ...]:
    """The variants to capture: (False,) without LoRA, (False, True) with it."""
    return (False, True) if batch is not None else (False,)


def capturing(batch, active: bool):
    """While a variant is captured: the layers run the LoRA kernels or not."""
    return batch.capturing(active) if batch is not None else contextlib.nullcontext()


def active(batch) -> bool:
    """Whether the step being run has tokens of an adapter (its graphs' variant)."""
    return batch is not None and batch.active
