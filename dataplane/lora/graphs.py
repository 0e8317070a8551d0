"""CUDA graphs of a worker serving LoRA adapters: every graph is captured twice, with the LoRA
kernels of its projections and without them, and a step replays the variant its batch needs
(``LoraBatch.active``: some token has an adapter). So a step of the base model alone replays
exactly the graphs of a worker without LoRA (no empty launches), and a step with adapters
reads their groups from the ``LoraBatch``'s static buffer. A model without LoRA has one variant.
"""

from __future__ import annotations

import contextlib


def variants(model) -> tuple[bool, ...]:
    """The variants to capture: (False,) without LoRA, (False, True) with it."""
    return (False, True) if getattr(model, "lora", None) is not None else (False,)


def capturing(model, active: bool):
    """While a variant is captured: the layers run the LoRA kernels or not."""
    batch = getattr(model, "lora", None)
    return batch.capturing(active) if batch is not None else contextlib.nullcontext()


def active(model) -> bool:
    """Whether the step being run has tokens of an adapter (its graphs' variant)."""
    batch = getattr(model, "lora", None)
    return batch is not None and batch.active
