"""The model's projections with the LoRA update of the step's adapters: ``install`` wraps each
layer's q/k/v, o, gate/up and down projections (plain, or quantized: any layer whose forward
takes float rows) in a ``LoraProjection``, which runs the base layer and then, while the
step's ``LoraBatch`` is active, the update over its slot buffers
(``headrace.dataplane.lora.slots``). A plain (unquantized) projection runs both as
``kernels.lora_linear``: at decode sizes one launch instead of three where the projection is
the skinny GEMM (each kernel a CUDA graph replays costs ~2 µs of latency, as much as a small
projection's weight read); a quantized one runs ``kernels.lora_update`` after its GEMM (the
update in one launch at decode sizes). A worker without ``--enable-lora`` installs nothing: its
model is unchanged.

A row-parallel projection (o_proj, down_proj) under tensor parallelism adds its update to the
rank's partial product before the all-reduce: each rank's A holds its input columns, so the
ranks' partial updates sum to the whole one, with no collective of their own. Its input must
be float rows: a LoRA projection never asks its producer for FP8 rows (``wants_fp8_rows``),
so an FP8 layer quantises its input itself.
"""

from __future__ import annotations

import torch
from torch import nn

from headrace import kernels
from headrace.dataplane import parallel
from headrace.dataplane.lora.batch import LoraBatch
from headrace.dataplane.lora.slots import ROW_PARALLEL, LoraSlots, Site
from headrace.dataplane.model import Linear, RowParallelLinear


class LoraProjection(nn.Module):
    def __init__(self, base: nn.Module, site: Site, slots: LoraSlots, batch: LoraBatch):
        super().__init__()
        self.base, self.site, self.batch = base, site, batch
        self.lora_a, self.lora_b = slots.views(site)
        self.slices = site.slices
        self.row_parallel = site.merged in ROW_PARALLEL
        # a plain (unquantized) projection of a decode runs with its update in one launch
        # (``kernels.lora_linear``); its two counters are this layer's own
        self.plain = type(base).forward in (Linear.forward, RowParallelLinear.forward)
        self.sync = torch.zeros(2, dtype=torch.int32, device=self.lora_a.device)

    def wants_fp8_rows(self, x: torch.Tensor) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        tp_rows = self.row_parallel and parallel.world_size() > 1
        if not batch.active:   # a step of the base model alone
            y = _partial(self.base, x) if tp_rows else self.base(x)
        else:
            x2 = x.reshape(-1, x.shape[-1])
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()   # (the kernels read unit-stride rows)
            if self.plain:
                y = kernels.lora_linear(x2, self.base.weight, None if tp_rows else self.base.bias,
                                        self.lora_a, self.lora_b, batch.meta, self.slices, self.sync)
                y = y.view(*x.shape[:-1], y.shape[-1])
            else:   # (its GEMM, then the update in place)
                y = _partial(self.base, x) if tp_rows else self.base(x)
                y = y if y.is_contiguous() else y.contiguous()
                kernels.lora_update(y.view(-1, y.shape[-1]), x2, self.lora_a, self.lora_b, batch.meta,
                                    self.slices, self.sync)
        if tp_rows:
            y = parallel.all_reduce(y)
            return y if self.base.bias is None else y + self.base.bias
        return y


def _partial(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial product, before its all-reduce and bias."""
    if hasattr(base, "matmul"):   # a quantized layer (headrace.dataplane.quantization.layers)
        return base.matmul(x, None)
    return kernels.linear(x, base.weight)


def install(model: nn.Module, slots: LoraSlots, batch: LoraBatch) -> int:
    """Wraps every site's projection of ``model``; returns how many."""
    layers = model.model.layers
    for site in slots.sites:
        parent = layers[site.layer].self_attn if site.merged in ("qkv_proj", "o_proj") \
            else layers[site.layer].mlp
        base = getattr(parent, site.merged)
        if isinstance(base, LoraProjection):
            raise RuntimeError("LoRA is installed already")
        setattr(parent, site.merged, LoraProjection(base, site, slots, batch))
    model.lora = batch
    return len(slots.sites)
