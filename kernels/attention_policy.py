"""Which attention kernel runs a step: ``--attention-backend {auto,triton,flash-attn}``.

Pure Python (no torch): the worker resolves the requested backend once at start (``resolve``), with
the reason flash-attn-4 cannot run on this device (or None when it can, from
``headrace.kernels.flash_attn4.unusable``); the runner then asks the resolved ``Policy`` once per
step (``choose``) and hands the answer to every layer, so no layer repeats the choice.

A step is in one of three phases: ``decode`` (every sequence computes one token), ``prefill``
(no one-token sequence first) or ``mixed`` (decodes first, then prefill chunks). The size of a
step's prefill part is the number of query-key pairs its causal attention computes
(``prefill_pairs``, from the step's host arrays), compared with what one dense prompt of
``crossover`` tokens computes, ``crossover * (crossover + 1) / 2``. So a dense prompt counts
its length, a 2048-token chunk over a 26k-token cached prefix like a 10.5k-token prompt and 29
prompts of 560 tokens like one of 3k; the crossover reads off the bench's dense table
(bench/attention_backends.py).

``auto``'s table (as vLLM's selection does: the fastest measured backend the device supports,
the portable one otherwise):

=========  ==================================================================
decode     triton (split-KV decode inside the CUDA graphs; flash-attn-4 has no
           split-KV on SM90 and its calls stay outside graphs)
prefill    flash-attn when the pairs reach a dense prompt of FLASH_ATTN_CROSSOVER_TOKENS
mixed      the same test on the prefill part; the decodes keep Triton's kernel
=========  ==================================================================

``flash-attn`` sends every prefill and mixed step's prefill part to flash-attn-4 whatever its
size (decodes stay on Triton as above); ``triton`` never uses it. On a CPU device every
backend is the plain-torch reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BACKENDS = ("auto", "triton", "flash-attn")
PHASES = ("decode", "prefill", "mixed")
TRITON, FLASH = "triton", "flash-attn"
PACKAGE = "flash-attn-4"
INSTALL_HINT = "pip install 'headrace[flash-attn]'"

# Equivalent dense causal prefill length above which flash-attn-4 beats our Triton prefill
# kernel on the device (H200, head_dim 128). Start value from issue 24's figures (Triton 302
# TFLOP/s at 1k, 433 at 8k; flash-attn-4 26-85 at 1k for its ~0.1 ms host cost, 664 at 8k):
# set it from bench/attention_backends.py's crossover row.
FLASH_ATTN_CROSSOVER_TOKENS = 2048


def prefill_pairs(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_decodes: int) -> int:
    """Query-key pairs of the causal attention of sequences num_decodes.. (host arrays: the
    step's cumulative query lengths and context lengths): a chunk of q tokens ending a context
    of c sees q * (c - q) cached keys and q * (q + 1) / 2 of its own."""
    q = np.diff(query_start_loc[num_decodes:]).astype(np.int64)
    c = seq_lens[num_decodes:].astype(np.int64)
    return int((q * (c - q) + q * (q + 1) // 2).sum())


def phase_of(decode_only: bool, num_decodes: int) -> str:
    if decode_only:
        return "decode"
    return "mixed" if num_decodes > 0 else "prefill"


@dataclasses.dataclass(frozen=True)
class Policy:
    """A resolved backend. ``requested``: what the flag said; ``backend``: triton, flash-attn or
    auto (only when flash-attn-4 is usable); ``reason``: why auto fell back (or None)."""

    requested: str
    backend: str
    reason: str | None = None
    crossover: int = FLASH_ATTN_CROSSOVER_TOKENS

    @property
    def uses_flash(self) -> bool:
        return self.backend != TRITON

    def choose(self, decode_only: bool, num_decodes: int, pairs: int) -> str:
        """The kernel of a step's prefill part (``triton`` or ``flash-attn``): ``pairs`` is
        its ``prefill_pairs``. Decode-only steps are always ``triton``."""
        if decode_only or self.backend == TRITON or pairs <= 0:
            return TRITON
        if self.backend == FLASH:
            return FLASH
        return FLASH if 2 * pairs >= self.crossover * (self.crossover + 1) else TRITON

    def table(self) -> dict[str, str]:
        """Phase -> what runs it, for the start-up log line."""
        if self.backend == TRITON:
            return {p: TRITON for p in PHASES}
        if self.backend == FLASH:
            return {"decode": TRITON, "prefill": FLASH, "mixed": f"{FLASH} (decodes: {TRITON})"}
        above = f"{FLASH} from {self.crossover} equivalent tokens, {TRITON} below"
        return {"decode": TRITON, "prefill": above, "mixed": above + f" (decodes: {TRITON})"}

    def describe(self) -> str:
        text = f"attention backend {self.requested}: " + "; ".join(
            f"{phase} -> {kernel}" for phase, kernel in self.table().items())
        return text + (f" ({self.reason})" if self.reason else "")


def resolve(requested: str, device_type: str, flash_unusable: str | None) -> Policy:
    """The policy for ``--attention-backend requested`` on a ``device_type`` (cpu or cuda)
    device. ``flash_unusable``: why flash-attn-4 cannot run here (None: it can). An explicit
    ``flash-attn`` that cannot run is a ValueError naming the missing package or device."""
    if requested not in BACKENDS:
        raise ValueError(f"--attention-backend {requested!r}: choose from {', '.join(BACKENDS)}")
    if device_type != "cuda":
        if requested == FLASH:
            raise ValueError(f"--attention-backend {FLASH}: {PACKAGE} needs a CUDA device "
                             f"(--device {device_type}); use --attention-backend auto or triton")
        return Policy(requested, TRITON, f"{device_type}: the plain-torch reference")
    if requested == TRITON:
        return Policy(requested, TRITON)
    if flash_unusable is not None:
        if requested == FLASH:
            raise ValueError(f"--attention-backend {FLASH}: {flash_unusable}")
        return Policy(requested, TRITON, f"{FLASH} not used: {flash_unusable}")
    return Policy(requested, requested)
