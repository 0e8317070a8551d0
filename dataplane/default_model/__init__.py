"""The small embedded default model that ``headrace serve`` uses with no arguments.

``tiny/`` is a Hugging Face model directory (``config.json``, bfloat16
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``) holding a ~3.4M-parameter ``LlamaForCausalLM``
(4 layers, hidden 256, 4 heads / 2 KV heads, tied embeddings) and a 2048-entry
byte-level BPE tokenizer (``<s>`` = 0 is prepended on encode, ``</s>`` = 1
ends a document). It was trained from scratch in about 12 CPU minutes on Jane
Austen's *Pride and Prejudice* (public domain, see ``CORPUS.md``), so it streams
word-like, Austen-flavoured text, not sensible answers. ``train.py`` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_model_dir"]


def default_model_dir() -> Path:
    """Return the path of the bundled ``tiny`` model directory."""
    return Path(__file__).resolve().parent / "tiny"
