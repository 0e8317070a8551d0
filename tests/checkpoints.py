"""Tiny random Hugging Face checkpoints (made with transformers) and a tokenizer for tests."""

from __future__ import annotations

import json
import pathlib

import torch

ARCHS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}
VOCAB = 384


def write_tokenizer(path: pathlib.Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, padded out to vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld — ünïcode ✓ 日本語",
            "serving engines stream tokens to clients over grpc"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 256,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_checkpoint(path: pathlib.Path, arch: str = "llama", *, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 32, tie: bool = False, layers: int = 2, seed: int = 0,
                    extra: dict | None = None, vocab: int = VOCAB) -> pathlib.Path:
    """Saves a random model of the given family; weights drawn large enough that greedy
    decoding has clear winners (no near-ties between float32 implementations). ``vocab`` may
    exceed the tokenizer's VOCAB (extra ids are never produced by it)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    cls = getattr(transformers, ARCHS[arch])
    hidden = heads * head_dim if head_dim >= 64 else 128
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=head_dim, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1,
              initializer_range=0.15, **({"max_position_embeddings": 256} | (extra or {})))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path
