"""Builds a ``CausalLM`` and fills it from a Hugging Face safetensors checkpoint.

Tensors are read one at a time (``safe_open``) and copied into the merged parameters,
so no rank ever holds a second copy of the whole checkpoint in memory. Under tensor
parallelism each rank reads only its shard of each tensor (``get_slice``, see ``_target``).
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from safetensors import safe_open

from headrace.dataplane.config import ModelConfig
from headrace.dataplane.model import CausalLM
from headrace.dataplane.parallel import Shard, merged_part
from headrace.dataplane.progress import Progress
from headrace.dataplane.quantization import QuantConfig, loading as quant_loading
from headrace.dataplane.rotary import cos_sin_cache

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


@dataclasses.dataclass
class _Plan:
    """Where (part of) one checkpoint tensor lands: ``param.narrow(0, dest_start, ...)`` gets
    the checkpoint's ``[src_start, src_start + length)`` along ``dim`` (whole tensor: dim None)."""

    param: torch.Tensor | None
    key: str
    dim: int | None = None
    full: int = 0            # the checkpoint's size along dim
    src_start: int = 0
    length: int = 0
    dest_start: int = 0


def _target(cfg: ModelConfig, shard: Shard, params: dict[str, torch.Tensor], name: str):
    """The ``_Plan`` of a checkpoint tensor, or None to skip it."""
    if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, index = _MERGED[parts[-2]]
        key = ".".join(parts[:-2] + [merged, parts[-1]])
        full, src, rows, dest = merged_part(cfg, shard, merged, index)
        return _Plan(params.get(key), f"{key}[{index}]", 0, full, src, rows, dest)
    param = params.get(name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _Plan(param, name, 0, cfg.vocab_size, shard.vocab_start, shard.vocab_rows)
    if parts[-2:] == ["o_proj", "weight"]:
        q = shard.num_heads * cfg.head_dim
        return _Plan(param, name, 1, cfg.q_size, shard.head_start * cfg.head_dim, q)
    if parts[-2:] == ["down_proj", "weight"]:
        i = shard.intermediate_size
        return _Plan(param, name, 1, cfg.intermediate_size, shard.rank * i, i)
    return _Plan(param, name)


def _read(f, name: str, plan: _Plan) -> torch.Tensor:
    """Reads only the part of the tensor this rank holds."""
    if plan.dim is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if len(shape) <= plan.dim or shape[plan.dim] != plan.full:
        raise CheckpointError(f"{name}: checkpoint shape {tuple(shape)} has no size {plan.full} "
                              f"along dim {plan.dim}")
    end = plan.src_start + plan.length
    return sl[plan.src_start:end] if plan.dim == 0 else sl[:, plan.src_start:end]


def checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(model_dir: str | pathlib.Path, cfg: ModelConfig, device: torch.device,
               dtype: torch.dtype, max_positions: int, shard: Shard | None = None,
               quant: QuantConfig | None = None) -> CausalLM:
    """``quant``: the projections' quantization (``headrace.dataplane.quantization``), None for
none."""
    model_dir = pathlib.Path(model_dir)
    shard = shard or Shard.of(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, shard)
        if quant is not None and quant.fmt != "online":
            quant_loading.prepare(model, quant)
    qload = quant_loading.QuantLoader(quant, cfg, shard, model)
    # ``to_empty`` without ``empty_like``: on meta tensors that runs torch's Python reference,
    # whose first call imports torch.fx's symbolic shapes (~1 s of a CPU start)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)).to(dtype)
    with torch.no_grad():   # padded vocabulary rows stay zero
        for p in model.parameters():
            p.zero_()
    model.model.cos_sin = cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta,
                                        cfg.rope_scaling, device)
    model.rebind_rotary()
    params = dict(model.named_parameters())
    expected = {_target(cfg, shard, params, n).key for n in _hf_names(cfg)
                if not qload.owns(n)}
    loaded: set[str] = set()
    files = checkpoint_files(model_dir)
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    with torch.no_grad(), Progress("loading weights", total, "tensors", rank=shard.rank) as progress:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if qload.owns(name):
                        qload.take(name, f.get_tensor)
                        continue
                    plan = _target(cfg, shard, params, name)
                    if plan is None:
                        progress.update()
                        continue
                    if plan.param is None:
                        raise CheckpointError(f"unexpected tensor {name!r} in {path.name}")
                    tensor = _read(f, name, plan)
                    dest = plan.param if plan.dim != 0 else plan.param.narrow(
                        0, plan.dest_start, plan.length)
                    if tensor.shape != dest.shape:
                        raise CheckpointError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded.add(plan.key)
                    progress.update()
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if quant is not None:
        with torch.no_grad():
            qload.finish(device)
            if quant.fmt == "online":
                quant_loading.quantize_online(model, quant)
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
