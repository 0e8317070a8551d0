"""The small embedded default model that ``headrace serve`` uses with no arguments.

``tiny/`` is a Hugging Face model directory (``config.json``, bfloat16
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``) holding a ~3.4M-parameter ``LlamaForCausalLM``
(4 layers, hidden 256, 4 heads / 2 KV heads, tied embeddings) and a 2048-entry
byte-level BPE tokenizer (``<s>`` = 0 is prepended on encode, ``</s>`` = 1
ends a document). It was trained from scratch in about 12 CPU minutes on Jane
Austen's *Pride and Prejudice* (public domain, see ``CORPUS.md``), so it streams
word-like, Austen-flavoured text, not sensible answers. ``train.py`` rebuilds it.

``tiny-draft/`` is its draft model for speculative decoding (``method: draft_model``):
a ~0.7M-parameter ``LlamaForCausalLM`` (3 layers, hidden 128, 2 heads / 1 KV head,
head_dim 64) trained by ``train.py`` on the same corpus, with the target's tokenizer
files copied byte for byte. Its measured acceptance is in ``CORPUS.md``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_draft_model_dir", "default_model_dir"]


def default_model_dir() -> Path:
    """Return the path of the bundled ``tiny`` model directory."""
    return Path(__file__).resolve().parent / "tiny"


def default_draft_model_dir() -> Path:
    """Return the path of the bundled ``tiny-draft`` model directory (the draft of ``tiny``)."""
    return Path(__file__).resolve().parent / "tiny-draft"
