"""The quantized linear layers that replace the model's projections (never the LM head).

``Fp8Linear`` (W8A8: e4m3 weight, per-row scales, per-token or static activation scale) and
``WNA16Linear`` (4- or 8-bit integer weights packed for ``kernels.wna16_linear``, group scales
and zeros, activations in the model dtype) call the kernels in ``kernels``, which pick the
plain-torch reference or the Triton twin by device. ``build`` turns a (sharded, merged)
``QWeight`` into one of them; ``RowParallel`` variants all-reduce their partial products.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from dataplane import parallel
from dataplane.quantization.formats import QWeight
from kernels import reference_quant


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class WNA16Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, perm: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = qweight.shape[0] * (32 // bits), qweight.shape[1]
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros),
                        ("g_idx", g_idx), ("perm", perm)):
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            return kernels.wna16_linear(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                        self.perm, self.bits, self.group_size, bias)
        # CPU (CI, the tiny default model): the reference, its dequantised weight made once
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = reference_quant.dequantize_wna16(self.qweight, self.scales, self.zeros,
                                                           self.g_idx, self.bits, x.dtype)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return torch.nn.functional.linear(x, self._dense, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class _RowParallel:
    """Partial products summed across ranks, then the (replicated) bias added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return self.matmul(x, self.bias)
        y = parallel.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class RowParallelFp8Linear(_RowParallel, Fp8Linear):
    pass


class RowParallelWNA16Linear(_RowParallel, WNA16Linear):
    pass


def _sorted_groups(g_idx: torch.Tensor, groups: int):
    """(perm or None, compact sorted g_idx, group ids kept, group_size or 0 when the sorted
    groups are not equal contiguous runs)."""
    k = g_idx.numel()
    perm = torch.argsort(g_idx, stable=True)
    if torch.equal(perm, torch.arange(k, device=perm.device)):
        perm = None
    g = g_idx if perm is None else g_idx[perm]
    kept, compact = torch.unique(g, sorted=True, return_inverse=True)
    counts = torch.bincount(compact)
    size = int(counts[0]) if len(counts) else 0
    equal = bool((counts[:-1] == size).all()) and int(counts[-1]) <= size if len(counts) else False
    return perm, compact, kept, size if equal else 0


def build(w: QWeight, bits: int, row_parallel: bool, bias: torch.Tensor | None,
          device: torch.device) -> nn.Module:
    """The layer for ``w`` (this rank's part), its tensors on ``device``."""
    if w.zero is None:   # FP8
        cls = RowParallelFp8Linear if row_parallel else Fp8Linear
        scale_in = None if w.input_scale is None else w.input_scale.reshape(1).to(device)
        return cls(w.q.to(device).contiguous(), w.scale.float().to(device).contiguous(),
                   scale_in, bias)
    perm, g_idx, kept, group_size = _sorted_groups(w.g_idx.to(w.q.device), w.scale.shape[0])
    q = w.q if perm is None else w.q[:, perm]
    qweight = reference_quant.pack_along_k(q.cpu(), bits)
    cls = RowParallelWNA16Linear if row_parallel else WNA16Linear
    kept = kept.to(w.scale.device)
    # scales stay float32: a checkpoint's fp16 scales would lose bits as bfloat16
    return cls(qweight.to(device), w.scale[kept].float().to(device).contiguous(),
               w.zero[kept].to(device).contiguous(), g_idx.to(torch.int32).to(device),
               None if perm is None else perm.to(device), bits, group_size, bias)
