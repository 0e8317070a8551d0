"""Reads a LoRA adapter in Hugging Face PEFT format (``adapter_config.json`` and
``adapter_model.safetensors``), checks it against the served model and this worker's limits,
and returns this rank's shard of its weights, with its scaling folded into B.

Supported: ``peft_type`` LORA on any of q/k/v/o_proj and gate/up/down_proj of any layer, any
rank up to ``--max-lora-rank`` (per module too: ``rank_pattern``), ``lora_alpha`` (and
``alpha_pattern``) scaling ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``. Refused
with a message naming what to change: DoRA, LoRA on the embeddings or the LM head, trainable
tokens, ``modules_to_save``, LoRA biases, ``fan_in_fan_out`` (Conv1D) weights, other modules
or PEFT methods, a rank over the limit, and weights whose shapes (or ``auto_mapping``'s class)
say the adapter was trained for another base model.

Tensor parallelism (``headrace.dataplane.parallel.Shard``): A is sharded like its layer's input, B like
its output: the column-parallel q/k/v and gate/up keep all of A and their rows of B (the rows
of the heads and MLP columns the rank holds, as ``headrace.dataplane.loader`` shards the weights); the
row-parallel o_proj and down_proj keep their columns of A and all of B (their partial updates
are summed by the layer's all-reduce).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import torch
import xxhash
from safetensors import safe_open

from headrace.dataplane.config import ModelConfig
from headrace.dataplane.parallel import Shard, merged_part

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# config keys naming a feature this worker does not serve, and what to say about it
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported; merge the magnitude vectors or train plain LoRA",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices) are not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served here: the message says why and what to do."""


class AdapterNotFound(AdapterError, FileNotFoundError):
    """No adapter at the path (vLLM answers 404 for it; the other refusals are 400)."""


@dataclasses.dataclass
class Adapter:
    """One rank's share of an adapter: per (layer, projection) its A [r, in] and B [out, r]
    (B times the module's scaling), in the model dtype on the CPU."""

    path: str
    rank: int                                   # the largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: int                            # xxh64 of the config and weights files' bytes
    num_bytes: int = 0                          # the weights' bytes on this rank


def read_config(path: pathlib.Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterNotFound(f"{path}: no such adapter directory")
    if not cfg_path.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{cfg_path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: not a JSON object")
    return cfg


def check_config(cfg: dict, path: pathlib.Path, model: ModelConfig, max_rank: int) -> None:
    """AdapterError unless ``cfg`` (an adapter_config.json) is a LoRA this worker serves."""
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {kind!r}; only LoRA adapters are served")
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"{path}: {why}")
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{path}: bias {cfg['bias']!r}: LoRA adapters that train biases are not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out"):
            raise AdapterError(f"{path}: LoRA on {leaf} (the embeddings or LM head) is not supported; "
                               f"served modules: {', '.join(PROJECTIONS)}")
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    if max(int(r) for r in ranks) > max_rank:
        raise AdapterError(f"{path}: rank {max(int(r) for r in ranks)} is over --max-lora-rank "
                           f"{max_rank}; restart with a larger --max-lora-rank")
    base = (cfg.get("auto_mapping") or {}).get("base_model_class")
    if base and base != model.architecture:
        raise AdapterError(f"{path}: trained for a {base} (base model "
                           f"{cfg.get('base_model_name_or_path')!r}); this server serves a "
                           f"{model.architecture}")


def _pattern(patterns: dict, module: str, default):
    """peft's ``get_pattern_key``: the first pattern matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def scaling(cfg: dict, module: str) -> tuple[int, float]:
    """(rank, scaling) of ``module`` (e.g. ``model.layers.0.self_attn.q_proj``), as peft sets them."""
    r = int(_pattern(cfg.get("rank_pattern"), module, cfg.get("r", 8)))
    alpha = float(_pattern(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8)))
    return r, (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)


def _dims(model: ModelConfig, proj: str) -> tuple[int, int]:
    """(in, out) features of an HF projection of the whole model."""
    h, i = model.hidden_size, model.intermediate_size
    return {"q_proj": (h, model.q_size), "k_proj": (h, model.kv_size), "v_proj": (h, model.kv_size),
            "o_proj": (model.q_size, h), "gate_proj": (h, i), "up_proj": (h, i),
            "down_proj": (i, h)}[proj]


def _shard_rows(model: ModelConfig, shard: Shard, proj: str) -> tuple[int, int] | None:
    """The rows of B (column-parallel) this rank holds, or None for all."""
    index = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}.get(proj)
    if index is None:
        return None
    merged = "qkv_proj" if proj in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
    _, src, rows, _ = merged_part(model, shard, merged, index)
    return src, rows


def _shard_cols(model: ModelConfig, shard: Shard, proj: str) -> tuple[int, int] | None:
    """The columns of A (row-parallel) this rank holds, or None for all."""
    if proj == "o_proj":
        return shard.head_start * model.head_dim, shard.num_heads * model.head_dim
    if proj == "down_proj":
        return shard.rank * shard.intermediate_size, shard.intermediate_size
    return None


def fingerprint(path: pathlib.Path) -> int:
    """xxh64 of the adapter's config and weights files (what identifies its KV in the caches)."""
    h = xxhash.xxh64()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.intdigest()


def load(path: str | pathlib.Path, model: ModelConfig, shard: Shard | None, max_rank: int,
         dtype: torch.dtype) -> Adapter:
    """This rank's share of the adapter in ``path`` (AdapterError when it cannot be served)."""
    path = pathlib.Path(path)
    shard = shard or Shard.of(model)
    cfg = read_config(path)
    check_config(cfg, path, model, max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        other = " (adapter_model.bin, a pickle, is not read: save it with safetensors)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}{other}")
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    what = "DoRA magnitudes" if "magnitude" in key else \
                        "embedding LoRA" if "embedding" in key or "embed" in key else \
                        "LM-head weights" if "lm_head" in key else "an unsupported module"
                    raise AdapterError(f"{path}: tensor {key!r} ({what}) is not supported; served: "
                                       f"LoRA A/B of {', '.join(PROJECTIONS)}")
                layer, parent, proj, ab = int(m[1]), m[2], m[3], m[4]
                if proj not in PROJECTIONS or PARENT[proj] != parent:
                    raise AdapterError(f"{path}: LoRA on {parent}.{proj} is not supported; served "
                                       f"modules: {', '.join(PROJECTIONS)}")
                if layer >= model.num_layers:
                    raise AdapterError(f"{path}: has layer {layer}; this model has {model.num_layers} "
                                       f"layers: the adapter was trained for another base model")
                pairs.setdefault((layer, proj), {})[ab] = key
            weights, top, total = {}, 0, 0
            for (layer, proj), keys in sorted(pairs.items()):
                if set(keys) != {"A", "B"}:
                    raise AdapterError(f"{path}: layer {layer} {proj} has lora_{''.join(keys)} only")
                module = f"model.layers.{layer}.{PARENT[proj]}.{proj}"
                a, b = _read(f, keys["A"], keys["B"], model, shard, proj, path, max_rank)
                r, scale = scaling(cfg, module)
                if a.shape[0] != r:
                    raise AdapterError(f"{path}: {module} has rank {a.shape[0]}, its config says {r}")
                weights[(layer, proj)] = (a.to(dtype), (b.float() * scale).to(dtype))
                top = max(top, r)
                total += (a.numel() + b.numel()) * torch.empty(0, dtype=dtype).element_size()
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file: the caller's status says so
        raise AdapterError(f"{weights_path}: cannot be read ({exc})") from None
    if not weights:
        raise AdapterError(f"{path}: no LoRA weights of {', '.join(PROJECTIONS)}")
    return Adapter(str(path), top, weights, fingerprint(path), total)


def _read(f, key_a: str, key_b: str, model: ModelConfig, shard: Shard, proj: str,
          path: pathlib.Path, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    a_slice, b_slice = f.get_slice(key_a), f.get_slice(key_b)
    a_shape, b_shape = list(a_slice.get_shape()), list(b_slice.get_shape())
    size_in, size_out = _dims(model, proj)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise AdapterError(f"{path}: {key_a} {a_shape} and {key_b} {b_shape} are not a LoRA pair")
    if a_shape[1] != size_in or b_shape[0] != size_out:
        raise AdapterError(f"{path}: {proj} maps {a_shape[1]} -> {b_shape[0]} features, this "
                           f"model's {size_in} -> {size_out}: the adapter was trained for another "
                           f"base model")
    if a_shape[0] > max_rank:
        raise AdapterError(f"{path}: {key_a} has rank {a_shape[0]}, over --max-lora-rank {max_rank}; "
                           f"restart with a larger --max-lora-rank")
    cols, rows = _shard_cols(model, shard, proj), _shard_rows(model, shard, proj)
    a = a_slice[:, cols[0]:cols[0] + cols[1]] if cols else a_slice[:]
    b = b_slice[rows[0]:rows[0] + rows[1]] if rows else b_slice[:]
    return a, b
