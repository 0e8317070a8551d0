"""Per-format readers: one linear layer's checkpoint tensors -> a ``QWeight`` in one canonical
layout, whatever packed it (GPTQ, AWQ, compressed-tensors, FP8), so sharding, merging and the
kernels' repacking are written once (``headrace.dataplane.quantization.loading``).

Published layouts (``out`` x ``in`` is nn.Linear's weight shape; P = 32 / bits values per int32):

* GPTQ: ``qweight`` [in / P, out] packed along in (value k at bits (k % P) * bits of word
  k // P), ``qzeros`` [groups, out / P] packed the same way along out, ``scales`` [groups, out],
  ``g_idx`` [in] (act order). w = (q - z) * s; checkpoint_format ``gptq`` (v1) stores z - 1.
* AWQ (gemm): ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] packed along out in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble p of word j holds column 8 j + order[p]),
  ``scales`` [groups, out]; w = (q - z) * s.
* compressed-tensors pack-quantized: ``weight_packed`` [out, in / P] packed along in, signed
  values stored + 2^(bits-1); ``weight_scale`` [out, groups]; ``weight_zero_point`` (asym)
  [out / P, groups] packed along out, also offset; optional ``weight_g_idx`` [in].
  int-quantized: ``weight`` int8 [out, in], ``weight_scale`` [out, 1].
* FP8 (``fp8`` and compressed-tensors float-quantized): ``weight`` e4m3 [out, in],
  ``weight_scale`` (one, or one per output row), optional static ``input_scale``.
"""

from __future__ import annotations

import dataclasses

import torch

from headrace.dataplane.quantization.config import QuantConfig, QuantizationError
from headrace.kernels import reference_quant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclasses.dataclass
class QWeight:
    """One linear layer (or a shard of it), unpacked: ``q`` [out, in] (uint8 unsigned integers,
    or e4m3); integer weights have ``scale``/``zero`` [groups, out] and ``g_idx`` [in]; FP8
    weights ``scale`` [out] and an optional one-element static ``input_scale``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    def rows(self, start: int, length: int) -> "QWeight":
        """Output rows [start, start + length) (a column-parallel shard)."""
        if self.zero is None:
            return dataclasses.replace(self, q=self.q[start:start + length],
                                       scale=self.scale[start:start + length])
        return dataclasses.replace(self, q=self.q[start:start + length],
                                   scale=self.scale[:, start:start + length],
                                   zero=self.zero[:, start:start + length])

    def cols(self, start: int, length: int) -> "QWeight":
        """Input columns [start, start + length) (a row-parallel shard; scales stay whole)."""
        g_idx = None if self.g_idx is None else self.g_idx[start:start + length]
        return dataclasses.replace(self, q=self.q[:, start:start + length], g_idx=g_idx)


def _need(tensors: dict, name: str, key: str, shape: tuple | None = None) -> torch.Tensor:
    if key not in tensors:
        raise QuantizationError(f"{name}: checkpoint lacks {name}.{key}")
    t = tensors[key]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise QuantizationError(f"{name}.{key}: checkpoint shape {tuple(t.shape)} != expected "
                                f"{tuple(shape)} for a {shape_note(name)}")
    return t


def shape_note(name: str) -> str:
    return f"layer {name} of the model's config"


def _unpack_rows(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C / P] int32 packed along the last dim -> [R, C] unsigned values."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    v = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # [R, C/P, P]
    if order is not None:   # nibble p holds column order[p]
        v = v[..., torch.argsort(torch.tensor(order))]
    return v.flatten(-2).to(torch.int16)


def _groups(n_in: int, gs: int) -> int:
    return 1 if gs <= 0 else -(-n_in // gs)


def _default_g_idx(n_in: int, gs: int) -> torch.Tensor:
    return torch.zeros(n_in, dtype=torch.int64) if gs <= 0 else torch.arange(n_in) // gs


def _g_idx(tensors: dict, name: str, key: str, n_in: int, gs: int, groups: int) -> torch.Tensor:
    if key not in tensors:
        return _default_g_idx(n_in, gs)
    g = _need(tensors, name, key, (n_in,)).to(torch.int64)
    if n_in and (g.min() < 0 or g.max() >= groups):
        raise QuantizationError(f"{name}.{key}: group indices outside [0, {groups})")
    return g


def gptq(tensors: dict, name: str, out: int, n_in: int, qc: QuantConfig) -> QWeight:
    bits, per = qc.bits, 32 // qc.bits
    if n_in % per or out % per:
        raise QuantizationError(f"{name}: shape [{out}, {n_in}] does not pack {per} per int32")
    g = _groups(n_in, qc.group_size)
    qweight = _need(tensors, name, "qweight", (n_in // per, out))
    scales = _need(tensors, name, "scales", (g, out))
    qzeros = _need(tensors, name, "qzeros", (g, out // per))
    q = _unpack_rows(qweight.t(), bits).reshape(out, n_in)   # packed along in: rows of qweight.t()
    zero = (_unpack_rows(qzeros, bits) + qc.zero_offset) % (1 << bits)
    g_idx = _g_idx(tensors, name, "g_idx", n_in, qc.group_size, g)
    return QWeight(q.to(torch.uint8), scales.float(), zero.to(torch.uint8), g_idx)


def awq(tensors: dict, name: str, out: int, n_in: int, qc: QuantConfig) -> QWeight:
    if out % 8:
        raise QuantizationError(f"{name}: output size {out} is not a multiple of 8 (awq packing)")
    g = _groups(n_in, qc.group_size)
    qweight = _need(tensors, name, "qweight", (n_in, out // 8))
    scales = _need(tensors, name, "scales", (g, out))
    q = _unpack_rows(qweight, 4, AWQ_ORDER).t()                # [out, in]
    if "qzeros" in tensors:
        zero = _unpack_rows(_need(tensors, name, "qzeros", (g, out // 8)), 4, AWQ_ORDER)
    else:
        zero = torch.full((g, out), 8, dtype=torch.int16)
    return QWeight(q.to(torch.uint8).contiguous(), scales.float(), zero.to(torch.uint8),
                   _default_g_idx(n_in, qc.group_size))


def ct_int(tensors: dict, name: str, out: int, n_in: int, qc: QuantConfig) -> QWeight:
    """compressed-tensors pack-quantized and int-quantized (int8)."""
    bits, offset = qc.bits, 1 << (qc.bits - 1)
    g = _groups(n_in, qc.group_size)
    if "weight_shape" in tensors and tuple(tensors["weight_shape"].tolist()) != (out, n_in):
        raise QuantizationError(f"{name}.weight_shape {tensors['weight_shape'].tolist()} != "
                                f"expected {[out, n_in]} for a {shape_note(name)}")
    if qc.fmt == "ct-pack":
        per = 32 // bits
        if n_in % per:
            raise QuantizationError(f"{name}: input size {n_in} does not pack {per} per int32")
        q = _unpack_rows(_need(tensors, name, "weight_packed", (out, n_in // per)), bits)
    else:
        q = _need(tensors, name, "weight", (out, n_in)).to(torch.int16) + offset
    scale = _need(tensors, name, "weight_scale", (out, g)).float().t()
    if qc.sym:
        zero = torch.full((g, out), offset, dtype=torch.int16)
    elif qc.fmt == "ct-pack":
        if out % (32 // bits):
            raise QuantizationError(f"{name}: output size {out} does not pack its zero points")
        zp = _need(tensors, name, "weight_zero_point", (out * bits // 32, g))
        zero = _unpack_rows(zp.t(), bits)                        # [g, out]
    else:
        zero = _need(tensors, name, "weight_zero_point", (out, g)).to(torch.int16).t() + offset
    g_idx = _g_idx(tensors, name, "weight_g_idx", n_in, qc.group_size, g)
    return QWeight(q.to(torch.uint8), scale.contiguous(), zero.to(torch.uint8).contiguous(), g_idx)


def fp8(tensors: dict, name: str, out: int, n_in: int, qc: QuantConfig) -> QWeight:
    w = _need(tensors, name, "weight", (out, n_in))
    if w.dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"{name}.weight: dtype {w.dtype} in an fp8 checkpoint "
                                f"(float8_e4m3fn expected)")
    scale = _need(tensors, name, "weight_scale").float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(out).contiguous()
    elif scale.numel() != out:
        raise QuantizationError(f"{name}.weight_scale: {scale.numel()} scales for {out} rows "
                                f"(per-tensor or per-channel expected)")
    input_scale = None
    if qc.static_input:
        input_scale = _need(tensors, name, "input_scale").float().reshape(-1)
        if input_scale.numel() != 1:
            raise QuantizationError(f"{name}.input_scale: {input_scale.numel()} elements (one)")
    return QWeight(w, scale, input_scale=input_scale)


def online(weight: torch.Tensor, qc: QuantConfig) -> QWeight:
    """A float weight [out, in] quantised at load: FP8 or INT8, one scale per output row."""
    if qc.method == "fp8":
        q, scale = reference_quant.quantize_fp8_weight(weight)
        return QWeight(q, scale)
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = (torch.round(w / scale[:, None]).clamp(-128, 127) + 128).to(torch.uint8)
    return QWeight(q, scale[None, :], torch.full((1, w.shape[0]), 128, dtype=torch.uint8,
                                                 device=w.device),
                   torch.zeros(w.shape[1], dtype=torch.int64, device=w.device))


READERS = {"gptq": gptq, "awq": awq, "ct-pack": ct_int, "ct-int": ct_int, "fp8": fp8,
           "ct-float": fp8}
