"""Writes Hugging Face checkpoints of real architectures with random bf16 weights (no model hub
is reachable) plus a word-level tokenizer covering the whole vocabulary, for benchmarks.

    python -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3-0.6b [--device cuda] [--tokenizer bytelevel]

``--tokenizer bytelevel`` writes a byte-level BPE vocabulary of the same size instead (the 256
bytes, JSON punctuation, digits and seeded letter strings, as Qwen's or Llama's tokenizers
spell them): grammars (structured outputs) need tokens that spell text, and their masks cost
what a real 150k-token vocabulary costs.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from safetensors.torch import save_file

CONFIGS = {
    # CPU-sized stand-in with the same code paths: profiles the planes' own overhead.
    "qwen3-tiny": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 16384, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # near-free steps on a CPU: what the control plane costs dominates (bench.core_overhead)
    "qwen3-micro": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1024, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
        if c["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def write_tokenizer(path: pathlib.Path, vocab_size: int, eos_id: int) -> None:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
           "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{eos_id}"}))


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in of each byte (what byte-level BPE vocabularies store)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_bytelevel_tokenizer(path: pathlib.Path, vocab_size: int, eos_id: int, seed: int = 0) -> None:
    import random

    spell = _byte_chars()
    enc = lambda text: "".join(spell[b] for b in text.encode())  # noqa: E731
    tokens = [spell[b] for b in range(256)]
    seen = set(tokens)
    pieces = ['{"', '":', '": ', '", "', '"}', ', ', '[{', '}]', '},', ' {"', '"]', ' "', 'true', 'false',
              'null'] + [f"{i:02d}" for i in range(100)] + [str(i) for i in range(100, 1000)]
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(tokens) < vocab_size - 1:
        text = pieces.pop(0) if pieces else (" " if rng.random() < 0.5 else "") + "".join(
            rng.choice(letters) for _ in range(rng.randint(2, 7)))
        if enc(text) not in seen:
            seen.add(enc(text))
            tokens.append(enc(text))
    eos = "<|endoftext|>"
    tokens.insert(eos_id, eos)
    vocab = {t: i for i, t in enumerate(tokens[:vocab_size])}
    tok = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
           "added_tokens": [{"id": eos_id, "content": eos, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}],
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "vocab": vocab, "merges": [], "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "ignore_merges": True}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


def write_checkpoint(name: str, out: pathlib.Path, device: str = "cpu", seed: int = 0,
                     tokenizer: str = "wordlevel", vocab_size: int | None = None) -> pathlib.Path:
    cfg = dict(CONFIGS[name], **({"vocab_size": vocab_size} if vocab_size else {}))
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for key, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
            t = t.to(torch.bfloat16).cpu()
        tensors[key] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer == "bytelevel":
        write_bytelevel_tokenizer(out, cfg["vocab_size"], cfg["eos_token_id"], seed)
    else:
        write_tokenizer(out, cfg["vocab_size"], cfg["eos_token_id"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("name", choices=sorted(CONFIGS))
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer", choices=("wordlevel", "bytelevel"), default="wordlevel",
                    help="bytelevel: a byte-level BPE vocabulary that spells text (structured outputs)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="another vocabulary size (e.g. qwen3-micro with Qwen's 151936: a grammar's "
                         "mask costs on a CPU what it costs on the GPU, over near-free steps)")
    args = ap.parse_args()
    write_checkpoint(args.name, args.out, args.device, tokenizer=args.tokenizer,
                     vocab_size=args.vocab_size)
    print(f"wrote {args.name} to {args.out}")


if __name__ == "__main__":
    main()
