"""Which grammar engine serves structured outputs (``--structured-outputs-backend``, vLLM's
``--structured-outputs-config.backend``), and what the control plane asks of one.

``guidance`` (llguidance, Rust) is the default: it imports no torch, so the engine core stays
a torch-free process (tests/test_architecture.py), and it fills bitmasks straight into numpy
memory. ``xgrammar`` (vLLM's and SGLang's default) is selectable; it imports torch and
transformers when it loads (its own dependencies, for its GPU kernels), so choosing it gives
the engine core torch. ``auto`` takes guidance when it is installed, else xgrammar.

A backend compiles a ``Constraint`` into a ``Compiled`` grammar (off the event loop:
``headrace.controlplane.structured.compiler``), and a compiled grammar gives each sequence its own
``Matcher``: it consumes the tokens the sequence samples and fills the packed bitmask of the
tokens allowed next (``bitmask_words`` int32 words, bit t % 32 of word t / 32 for token t).
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Protocol

import numpy as np

BACKENDS = ("auto", "xgrammar", "guidance")
MODULES = {"guidance": "llguidance", "xgrammar": "xgrammar"}
EXTRAS = {"guidance": "headrace[structured]", "xgrammar": "headrace[xgrammar]"}


class Matcher(Protocol):
    def accept(self, token: int) -> bool:
        """Consumes a sampled token; False when the grammar does not allow it."""

    def fill(self, row: np.ndarray) -> None:
        """Writes the bitmask of the tokens allowed next into ``row`` (int32, contiguous)."""

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` tokens consumed."""

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or it failed)."""


class Compiled(Protocol):
    def matcher(self) -> Matcher:
        """A matcher in the grammar's initial state."""


class Backend(Protocol):
    name: str
    vocab_size: int

    def compile(self, constraint) -> Compiled:
        """The constraint's grammar; ``ConstraintError`` naming the problem when it has none."""


class BackendUnavailable(RuntimeError):
    """The chosen grammar engine is not installed (the message says what to install)."""


def installed(name: str) -> bool:
    return importlib.util.find_spec(MODULES[name]) is not None


def missing_message(name: str) -> str:
    return (f"--structured-outputs-backend {name}: {MODULES[name]} is not installed; "
            f"pip install '{EXTRAS[name]}'")


def resolve(name: str) -> str:
    """The engine ``name`` stands for (auto: guidance, else xgrammar); BackendUnavailable
    when it is not installed, ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"--structured-outputs-backend {name!r}: choose from {', '.join(BACKENDS)}")
    if name == "auto":
        for candidate in ("guidance", "xgrammar"):
            if installed(candidate):
                return candidate
        raise BackendUnavailable("structured outputs need a grammar engine and none is installed: "
                                 "pip install 'headrace[structured]' (llguidance) or "
                                 "'headrace[xgrammar]'")
    if not installed(name):
        raise BackendUnavailable(missing_message(name))
    return name


def load(name: str, model_dir: str | pathlib.Path, vocab_size: int, eos_token_ids: list[int]) -> Backend:
    """The backend ``name`` (resolved) for the model's tokenizer (``model_dir/tokenizer.json``)
    and the model's vocabulary size (the logits' width, which may exceed the tokenizer's).
    Slow (it reads the vocabulary; xgrammar also imports torch): run it off the event loop."""
    tokenizer_file = pathlib.Path(model_dir) / "tokenizer.json"
    if name == "guidance":
        from headrace.controlplane.structured.guidance import GuidanceBackend

        return GuidanceBackend(tokenizer_file, vocab_size, eos_token_ids)
    from headrace.controlplane.structured.xgrammar_engine import XGrammarBackend

    return XGrammarBackend(tokenizer_file, vocab_size, eos_token_ids)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
