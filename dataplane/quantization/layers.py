"""The quantized linear layers that replace the model's projections (never the LM head).

``Fp8Linear`` (W8A8: e4m3 weight, per-row scales, per-token or static activation scale) and
``WNA16Linear`` (4- or 8-bit integer weights packed for ``kernels.wna16_linear``, group scales and
zeros, activations in the model dtype) call the kernels in ``kernels``: the plain-torch reference
where it runs (CPU), and on the GPU the kernel ``headrace.kernels.quant_dispatch`` plans for the
layer's scheme, shape and row count under ``--quant-backend`` (our Triton kernels, or a library's:
``headrace.kernels.quant_libs``). The plan, and any library layout it needs, is made at the layer's
first GPU call (the worker's warm-up, eager; ``warm_up`` then compiles every row bucket's kernel
before CUDA graphs are captured: the skinny kernels' tiles are pinned by the measured table or
computed, so this is a few compiles shared across shapes, no timing). ``build`` turns a (sharded,
merged) ``QWeight`` into a layer; ``RowParallel`` variants all-reduce their partial products.
"""

from __future__ import annotations

import torch
from torch import nn

from headrace import kernels
from headrace.dataplane import parallel
from headrace.dataplane.quantization.formats import QWeight
from headrace.kernels import quant_dispatch, quant_libs, reference_quant

W8A8_OURS = ("scaled_mm", "fp8_w8a8")   # our W8A8 kernels: they take kernels.Fp8Rows


class _Planned(nn.Module):
    """Per row count, the kernel of ``headrace.kernels.quant_dispatch``'s plan (on the Triton path)."""

    scheme = ""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.plan: quant_dispatch.Plan | None = None
        self.prepared: dict[str, object] = {}     # library or OWN_LAYOUT kernel -> its layout
        self._by_rows: dict[int, str] = {}

    def kernel(self, x2: torch.Tensor, m: int | None = None) -> str | None:
        """The kernel for x2's rows, or for m rows like x2's (None: the reference runs)."""
        if not kernels.on_triton(x2):
            return None
        m = x2.shape[0] if m is None else m
        name = self._by_rows.get(m)
        if name is None:
            if self.plan is None:
                self._make_plan(x2.dtype, x2.device)
            name = self.plan.kernel(m)
            if m <= quant_dispatch.BUCKETS[-2]:   # decode sizes: a bounded cache
                self._by_rows[m] = name
        return name

    def _make_plan(self, dtype: torch.dtype, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a quantized layer's first call is inside CUDA-graph capture; run "
                               "the model eagerly first (warm-up)")
        self.plan = quant_dispatch.plan(self.scheme, self.out_features, self.in_features,
                                        self.backend, lambda name: self.takes(name, dtype),
                                        max_layouts=quant_dispatch.layout_budget())
        # a library's layout (a view of the weight, or a copy), or our own kernels' copies
        for name in self.plan.kernels & (set(quant_libs.KERNEL_LIBRARY)
                                         | set(quant_dispatch.OWN_LAYOUT)):
            self.prepared[name] = self.prepare(name, dtype)

    def takes(self, name: str, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def prepare(self, name: str, dtype: torch.dtype):
        raise NotImplementedError

    def wants_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer takes its input for x's rows as ``kernels.Fp8Rows``."""
        return False


class Fp8Linear(_Planned):
    scheme = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 backend: str = "auto"):
        super().__init__(backend)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None   # the reference's dequantised weight (CPU)

    def takes(self, name: str, dtype: torch.dtype) -> bool:
        return quant_libs.takes(name, scheme="fp8", n=self.out_features, k=self.in_features,
                                dtype=dtype)

    def prepare(self, name: str, dtype: torch.dtype):
        return quant_libs.prepare_fp8(name, self.weight, self.weight_scale, dtype)

    def wants_fp8_rows(self, x: torch.Tensor) -> bool:
        """True where this layer's kernel for x's rows quantises them per token itself (W8A8
        with dynamic scales: torch._scaled_mm, our W8A8 skinny GEMM, FBGEMM's row-wise GEMM):
        the kernel making x then hands them over quantised (``kernels.fused_add_rms_norm_fp8``,
        ``kernels.silu_and_mul_fp8``), which saves that kernel's bf16 write and the
        quantiser's launch and read."""
        if self.input_scale is not None:
            return False
        name = self.kernel(x, x.numel() // x.shape[-1])
        return name in W8A8_OURS or (name in quant_libs.TAKES_FP8_ROWS and name in self.prepared)

    def matmul(self, x: torch.Tensor | kernels.Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, kernels.Fp8Rows):   # (only where wants_fp8_rows said so)
            name = self.kernel(x.q)
            if name in quant_libs.TAKES_FP8_ROWS and name in self.prepared:
                return quant_libs.run_fp8_rows(name, self.prepared[name], x, bias)
            return kernels.fp8_linear(x, self.weight, self.weight_scale, None, bias,
                                      kernel=name if name in W8A8_OURS else "scaled_mm",
                                      dense=self._dense)
        x2 = x.reshape(-1, self.in_features)
        name = self.kernel(x2)
        if name in self.prepared:
            y = quant_libs.run(name, self.prepared[name], x2.contiguous(), bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if kernels.on_triton(x):
            return kernels.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias,
                                      kernel=name)
        # the reference (CPU: CI, the tiny default model), its dequantised weight made once
        if self._dense is None:
            self._dense = reference_quant.dequantize_fp8(self.weight, self.weight_scale)
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias,
                                  dense=self._dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class WNA16Linear(_Planned):

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, perm: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None, backend: str = "auto"):
        super().__init__(backend)
        self.bits, self.group_size = bits, group_size
        self.scheme = f"w{bits}a16"
        self.in_features, self.out_features = qweight.shape[0] * (32 // bits), qweight.shape[1]
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros),
                        ("g_idx", g_idx), ("perm", perm)):
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None

    def takes(self, name: str, dtype: torch.dtype) -> bool:
        # our Triton kernels' modules import triton: only where they can run (never on a CPU)
        if name == "triton_skinny":
            from headrace.kernels import triton_w4a16

            return triton_w4a16.supports(self.bits, self.group_size, self.in_features)
        if name == "triton_tiled":
            from headrace.kernels import triton_w4a16_tiled

            return triton_w4a16_tiled.supports(self.bits, self.group_size, self.out_features,
                                               self.in_features)
        return quant_libs.takes(name, scheme="wna16", n=self.out_features, k=self.in_features,
                                dtype=dtype, bits=self.bits, group_size=self.group_size)

    def prepare(self, name: str, dtype: torch.dtype):
        if name == "triton_tiled":
            from headrace.kernels import triton_w4a16_tiled

            return triton_w4a16_tiled.pack_tiled(self.qweight)
        return quant_libs.prepare_wna16(name, self.qweight, self.scales, self.zeros, self.bits,
                                        self.group_size, dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        name = self.kernel(x2)
        if name == "triton_tiled":
            return kernels.wna16_linear(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                        self.perm, self.bits, self.group_size, bias, kernel=name,
                                        tiled=self.prepared[name])
        if name in self.prepared:
            if self.perm is not None:
                x2 = x2.index_select(1, self.perm)
            y = quant_libs.run(name, self.prepared[name], x2.contiguous(), bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if name is not None:
            return kernels.wna16_linear(x, self.qweight, self.scales, self.zeros, self.g_idx,
                                        self.perm, self.bits, self.group_size, bias, kernel=name)
        # the reference (CPU: CI, the tiny default model), its dequantised weight made once
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
          device: torch.device, backend: str = "auto") -> nn.Module:
    """The layer for ``w`` (this rank's part), its tensors on ``device``; ``backend``:
    ``--quant-backend``."""
    if w.zero is None:   # FP8
        cls = RowParallelFp8Linear if row_parallel else Fp8Linear
        scale_in = None if w.input_scale is None else w.input_scale.reshape(1).to(device)
        return cls(w.q.to(device).contiguous(), w.scale.float().to(device).contiguous(),
                   scale_in, bias, backend)
    perm, g_idx, kept, group_size = _sorted_groups(w.g_idx.to(w.q.device), w.scale.shape[0])
    q = w.q if perm is None else w.q[:, perm]
    qweight = reference_quant.pack_along_k(q.cpu(), bits)
    cls = RowParallelWNA16Linear if row_parallel else WNA16Linear
    kept = kept.to(w.scale.device)
    # scales stay float32: a checkpoint's fp16 scales would lose bits as bfloat16
    return cls(qweight.to(device), w.scale[kept].float().to(device).contiguous(),
               w.zero[kept].to(device).contiguous(), g_idx.to(torch.int32).to(device),
               None if perm is None else perm.to(device), bits, group_size, bias, backend)


def quantized_layers(model: nn.Module) -> list[_Planned]:
    return [m for m in model.modules() if isinstance(m, _Planned)]


@torch.inference_mode()
def warm_up(model: nn.Module, max_rows: int, dtype: torch.dtype) -> list[str]:
    """Runs one quantized layer of each kind and shape at every row bucket up to ``max_rows``
    (and one larger input), so every kernel is compiled, its split-K workspace sized and its
    library layout made before serving and before CUDA-graph capture (the skinny kernels'
    tiles are fixed per bucket and shape, autotuned only with HEADRACE_QUANT_AUTOTUNE=1);
    returns one line per layer kind: its plan."""
    seen, lines = set(), []
    for layer in quantized_layers(model):
        kind = (type(layer).__name__, layer.out_features, layer.in_features,
                getattr(layer, "bits", 8), getattr(layer, "group_size", 0))
        if kind in seen:
            continue
        seen.add(kind)
        device = layer.weight.device if isinstance(layer, Fp8Linear) else layer.qweight.device
        rows = [b for b in quant_dispatch.BUCKETS if b <= max_rows] + [max_rows + 1]
        for m in rows:
            layer.matmul(torch.zeros(m, layer.in_features, dtype=dtype, device=device), None)
        if layer.plan is not None:
            lines.append(f"{kind[0]} {kind[1]}x{kind[2]}: {layer.plan.describe()}")
    return lines
