"""Reads a Hugging Face ``config.json`` into the model description the data plane builds from."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from headrace.common.model_source import model_name

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3" | "linear", ...}
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(raw: dict) -> tuple[float, dict | None]:
    """Rope settings from either the transformers 5 ``rope_parameters`` dict or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
    params["rope_type"] = rope_type
    return theta, params


def load_model_config(model_dir: str | pathlib.Path) -> ModelConfig:
    path = pathlib.Path(model_dir)
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architectures {archs} not supported; expected one of {SUPPORTED_ARCHITECTURES}")
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if g is not None:
            eos_ids = tuple(dict.fromkeys(eos_ids + (tuple(g) if isinstance(g, list) else (g,))))
    attention_bias = bool(raw.get("attention_bias", False))
    theta, scaling = _rope(raw)
    return ModelConfig(
        name=model_name(path),
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=eos_ids,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
