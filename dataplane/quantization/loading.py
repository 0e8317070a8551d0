"""Loads the quantized projections: the seam between ``headrace.dataplane.loader`` and the formats.

Pre-quantized checkpoints: ``prepare`` swaps the model's projections (still on the meta device)
for weightless placeholders; ``QuantLoader.take`` collects every tensor of a quantized HF
projection (whole: packed tensors are small, and groups / packing do not split on a rank's
boundaries); ``finish`` reads each part into a ``QWeight``, cuts this rank's shard (output rows
of column-parallel q/k/v/gate/up, input columns of row-parallel o/down, scales with their rows;
a row-parallel act-order shard keeps the scale table whole and indexes it by its g_idx), merges
q/k/v and gate/up, and builds the layers. Float checkpoints with ``--quantization fp8|int8``
load as usual and ``quantize_online`` replaces the projections afterwards.
KV-cache scales (``self_attn.k_scale`` / ``v_scale``, or ``k_proj`` / ``v_proj.output_scale``)
land on the attention modules; they are used only with an FP8 KV cache.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from headrace.dataplane.config import ModelConfig
from headrace.dataplane.parallel import Shard, merged_part
from headrace.dataplane.quantization import formats, layers
from headrace.dataplane.quantization.config import QuantConfig, QuantizationError

MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|"
                   r"up_proj|down_proj)\.(\w+)$")
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:([kvq])_proj\.output_scale|"
                       r"([kvq]|prob)_scale)$")


def _merged_of(proj: str) -> tuple[str, int]:
    for merged, parts in MERGED.items():
        if proj in parts:
            return merged, parts.index(proj)
    raise KeyError(proj)


def full_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(out, in) of an HF projection of the whole model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
            "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}[proj]


def _shard(cfg: ModelConfig, shard: Shard, proj: str, w: formats.QWeight) -> formats.QWeight:
    merged, index = _merged_of(proj)
    if merged == "o_proj":
        return w.cols(shard.head_start * cfg.head_dim, shard.num_heads * cfg.head_dim)
    if merged == "down_proj":
        i = shard.intermediate_size
        return w.cols(shard.rank * i, i)
    _, src, rows, _ = merged_part(cfg, shard, merged, index)
    return w.rows(src, rows)


def _merge(parts: list[formats.QWeight], name: str) -> formats.QWeight:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if first.zero is None:
        scales = [p.input_scale for p in parts]
        input_scale = None if scales[0] is None else torch.stack(scales).amax().reshape(1)
        return formats.QWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               input_scale=input_scale)
    if any(not torch.equal(p.g_idx, first.g_idx) or p.scale.shape[0] != first.scale.shape[0]
           for p in parts):
        raise QuantizationError(f"{name}: the merged projections have different group layouts "
                                f"(g_idx); they share an input and must not")
    return formats.QWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts], 1),
                           torch.cat([p.zero for p in parts], 1), first.g_idx)


class _Pending(nn.Module):
    """A quantized projection before its tensors are read: only its bias, if any."""

    def __init__(self, bias: bool, out_features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None


def _projections(model):
    for i, layer in enumerate(model.model.layers):
        for merged, parent in _PARENT.items():
            yield i, merged, getattr(layer, parent)


def _quantized(qc: QuantConfig, i: int, merged: str) -> bool:
    """Whether layer i's merged projection is quantized (all its parts, or none)."""
    names = [f"model.layers.{i}.{_PARENT[merged]}.{p}" for p in MERGED[merged]]
    flags = {qc.ignores(n) for n in names}
    if len(flags) > 1:
        raise QuantizationError(f"{names}: the checkpoint quantizes only some of these merged "
                                f"projections; all or none is supported")
    return not flags.pop()


def prepare(model, qc: QuantConfig) -> None:
    """Swaps each quantized projection for a placeholder (model on the meta device)."""
    for i, merged, parent in _projections(model):
        if _quantized(qc, i, merged):
            old = getattr(parent, merged)
            setattr(parent, merged, _Pending(old.bias is not None, old.out_features))


class QuantLoader:
    def __init__(self, qc: QuantConfig | None, cfg: ModelConfig, shard: Shard, model):
        """``qc`` None: an unquantized checkpoint (only KV-cache scales are read here)."""
        self.qc, self.cfg, self.shard, self.model = qc, cfg, shard, model
        self.tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def owns(self, name: str) -> bool:
        """Whether ``name`` is read here rather than by the dense loader."""
        if _KV_SCALE.match(name):
            return True
        m = _PROJ.match(name)
        if m is None or m.group(4) == "bias" or self.qc is None or self.qc.fmt == "online":
            return False
        return _quantized(self.qc, int(m.group(1)), _merged_of(m.group(3))[0])

    def take(self, name: str, tensor_of) -> None:
        kv = _KV_SCALE.match(name)
        if kv:
            kind = kv.group(2) or kv.group(3)
            if kind in ("k", "v"):
                attn = self.model.model.layers[int(kv.group(1))].self_attn
                setattr(attn, f"{kind}_scale", float(tensor_of(name).float().reshape(-1).max()))
            return
        m = _PROJ.match(name)
        self.tensors.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = tensor_of(name)

    def finish(self, device: torch.device) -> None:
        read = formats.READERS.get(self.qc.fmt)
        for i, merged, parent in _projections(self.model):
            pending = getattr(parent, merged)
            if not isinstance(pending, _Pending):
                continue
            parts = []
            for proj in MERGED[merged]:
                name = f"model.layers.{i}.{_PARENT[merged]}.{proj}"
                if (i, proj) not in self.tensors:
                    raise QuantizationError(f"checkpoint lacks the tensors of {name}")
                out, n_in = full_shape(self.cfg, proj)
                w = read(self.tensors.pop((i, proj)), name, out, n_in, self.qc)
                parts.append(_shard(self.cfg, self.shard, proj, w))
            w = _merge(parts, f"model.layers.{i}.{merged}")
            setattr(parent, merged, layers.build(w, self.qc.bits, merged in ("o_proj", "down_proj"),
                                                 pending.bias, device, self.qc.backend))
        if self.tensors:
            raise QuantizationError(f"unexpected quantized tensors for {sorted(self.tensors)[:3]}")


def quantize_online(model, qc: QuantConfig) -> None:
    """Replaces every projection of a loaded float model by its FP8 / INT8 version."""
    for _, merged, parent in _projections(model):
        old = getattr(parent, merged)
        w = formats.online(old.weight.detach(), qc)
        setattr(parent, merged, layers.build(w, qc.bits, merged in ("o_proj", "down_proj"),
                                             old.bias, old.weight.device, qc.backend))
        del old
