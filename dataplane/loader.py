"""Builds a ``CausalLM`` and fills it from a Hugging Face safetensors checkpoint.

Tensors are read one at a time (``safe_open``) and copied into the merged parameters,
so no rank ever holds a second copy of the whole checkpoint in memory.
"""

from __future__ import annotations

import pathlib

import torch
from safetensors import safe_open

from dataplane.config import ModelConfig
from dataplane.model import CausalLM
from dataplane.rotary import cos_sin_cache

# HF projection name -> (merged parameter name, index of the shard inside it)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CheckpointError(ValueError):
    """The checkpoint is missing tensors or has tensors of the wrong shape."""


def _shard_rows(cfg: ModelConfig, merged: str, index: int) -> tuple[int, int]:
    if merged == "qkv_proj":
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:index])
    return start, sizes[index]


def _target(cfg: ModelConfig, params: dict[str, torch.Tensor], name: str):
    """(parameter, row offset, rows, parameter key) a checkpoint tensor lands in, or None to skip."""
    if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, index = _MERGED[parts[-2]]
        key = ".".join(parts[:-2] + [merged, parts[-1]])
        start, rows = _shard_rows(cfg, merged, index)
        return params.get(key), start, rows, f"{key}[{index}]"
    param = params.get(name)
    return param, 0, None if param is None else param.shape[0], name


def checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(model_dir: str | pathlib.Path, cfg: ModelConfig, device: torch.device,
               dtype: torch.dtype, max_positions: int) -> CausalLM:
    model_dir = pathlib.Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.model.cos_sin = cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta,
                                        cfg.rope_scaling, device)
    model.rebind_rotary()
    params = dict(model.named_parameters())
    expected = {_target(cfg, params, n)[3] for n in _hf_names(cfg)}
    loaded: set[str] = set()
    with torch.no_grad():
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target = _target(cfg, params, name)
                    if target is None:
                        continue
                    param, start, rows, key = target
                    if param is None:
                        raise CheckpointError(f"unexpected tensor {name!r} in {path.name}")
                    tensor = f.get_tensor(name)
                    dest = param.narrow(0, start, rows)
                    if tensor.shape != dest.shape:
                        raise CheckpointError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded.add(key)
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model.eval()


def _hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name a complete HF checkpoint of this config holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(p + f"self_attn.{proj}.weight")
            if cfg.qkv_bias:
                names.append(p + f"self_attn.{proj}.bias")
        names.append(p + "self_attn.o_proj.weight")
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(p + f"mlp.{proj}.weight")
            if cfg.mlp_bias:
                names.append(p + f"mlp.{proj}.bias")
    return names
