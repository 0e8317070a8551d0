"""Which quantization scheme a model runs with: ``--quantization`` and the checkpoint's
``quantization_config`` (config.json), resolved as vLLM does.

* No ``quantization_config``: ``fp8`` (W8A8, per-channel weight scales, dynamic per-token
  activations) and ``int8`` (W8A16, per-channel) quantise a float checkpoint at load;
  ``gptq`` / ``awq`` / ``compressed-tensors`` need a quantized checkpoint.
* A ``quantization_config``: its ``quant_method`` (``fp8``, ``gptq``, ``awq``,
  ``compressed-tensors``) decides; ``--quantization``, when given, must name the same method.

Anything outside what the loaders implement (a bit width, a group layout, block-wise FP8,
integer activations, ...) is a ``QuantizationError`` naming it, raised before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

METHODS = ("fp8", "int8", "gptq", "awq", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # fp8_e4m3: vLLM's name for the same e4m3 cache
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


class QuantizationError(ValueError):
    """An unsupported or inconsistent quantization method, bit width, layout or checkpoint."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str                 # one of METHODS
    fmt: str                    # checkpoint layout: "online" (float checkpoint), "fp8", "gptq",
    #                             "awq", "ct-float" (compressed-tensors float-quantized),
    #                             "ct-pack" (pack-quantized), "ct-int" (int-quantized)
    bits: int = 8
    group_size: int = -1        # -1: one group per output channel
    sym: bool = True
    desc_act: bool = False      # GPTQ act order: a g_idx tensor per layer
    zero_offset: int = 0        # GPTQ v1 stores zero - 1: the loader adds this back
    static_input: bool = False  # FP8: a checkpoint input_scale instead of dynamic per-token
    ignore: tuple[str, ...] = ()
    backend: str = "auto"       # --quant-backend: which kernels run the layers on the GPU

    @property
    def fp8(self) -> bool:
        """W8A8 FP8 layers (otherwise integer weights, activations in the model dtype)."""
        return self.fmt in ("fp8", "ct-float") or (self.fmt == "online" and self.method == "fp8")

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint left the HF module ``module`` unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False

    def describe(self) -> str:
        if self.fp8:
            return f"{self.method} (fp8 w8a8, {'static' if self.static_input else 'dynamic'} activations)"
        group = "per-channel" if self.group_size <= 0 else f"group {self.group_size}"
        return (f"{self.method} (int{self.bits} weights, {group}, {'sym' if self.sym else 'asym'}"
                f"{', act-order' if self.desc_act else ''})")


def _gptq(q: dict) -> QuantConfig:
    bits, gs = int(q.get("bits", 4)), int(q.get("group_size", 128))
    if bits not in (4, 8):
        raise QuantizationError(f"gptq: {bits}-bit weights are not supported (4 or 8)")
    if q.get("lm_head"):
        raise QuantizationError("gptq: a quantized lm_head is not supported")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return QuantConfig("gptq", "gptq", bits, _group(gs, "gptq"), bool(q.get("sym", True)),
                       bool(q.get("desc_act", False)), 1 if fmt == "gptq" else 0,
                       ignore=tuple(q.get("modules_to_not_convert") or ()))


def _awq(q: dict) -> QuantConfig:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    gs = int(q.get("group_size", q.get("q_group_size", 128)))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise QuantizationError(f"awq: {bits}-bit weights are not supported (4)")
    if version != "gemm":
        raise QuantizationError(f"awq: version {version!r} is not supported (gemm)")
    return QuantConfig("awq", "awq", 4, _group(gs, "awq"), not q.get("zero_point", True),
                       ignore=tuple(q.get("modules_to_not_convert") or ()))


def _fp8(q: dict) -> QuantConfig:
    if q.get("weight_block_size"):
        raise QuantizationError(f"fp8: block-wise weight scales (weight_block_size "
                                f"{q['weight_block_size']}) are not supported")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"fp8: activation_scheme {scheme!r} is not supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8: format {fmt!r} is not supported (e4m3)")
    ignore = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    return QuantConfig("fp8", "fp8", static_input=scheme == "static", ignore=ignore)


def _group(gs: int, method: str) -> int:
    if gs == -1 or gs in (32, 64, 128, 256, 512, 1024):
        return gs
    raise QuantizationError(f"{method}: group size {gs} is not supported (-1, 32 .. 1024)")


def _compressed_tensors(q: dict) -> QuantConfig:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors: {len(groups)} config groups; one is supported")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or q.get("format")
    ignore = tuple(q.get("ignore") or ())
    kv = q.get("kv_cache_scheme")   # its k_scale / v_scale serve --kv-cache-dtype fp8
    if kv and not (kv.get("type") == "float" and kv.get("num_bits") == 8):
        raise QuantizationError(f"compressed-tensors: kv_cache_scheme {kv} is not supported (fp8)")
    if q.get("sparsity_config") or group.get("output_activations"):
        raise QuantizationError("compressed-tensors: sparsity and output activation quantization "
                                "are not supported")
    strategy, bits, kind = w.get("strategy"), int(w.get("num_bits", 0)), w.get("type")
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise QuantizationError(f"compressed-tensors fp8: weight strategy {strategy!r} is not "
                                    f"supported (tensor, channel)")
        if a is not None and (a.get("type") != "float" or a.get("num_bits") != 8
                              or a.get("strategy") not in ("token", "tensor")):
            raise QuantizationError(f"compressed-tensors fp8: input activations {a} not supported")
        static = a is not None and not a.get("dynamic", True)
        return QuantConfig("compressed-tensors", "ct-float", static_input=static, ignore=ignore)
    if fmt in ("pack-quantized", "int-quantized", "naive-quantized") and kind == "int":
        if a is not None:
            raise QuantizationError(f"compressed-tensors: integer weights with quantized input "
                                    f"activations ({a.get('type')}{a.get('num_bits')}) are not "
                                    f"supported (weight-only W4A16 / W8A16)")
        if fmt == "pack-quantized" and bits not in (4, 8) or fmt != "pack-quantized" and bits != 8:
            raise QuantizationError(f"compressed-tensors {fmt}: {bits}-bit weights are not supported")
        if strategy not in ("channel", "group"):
            raise QuantizationError(f"compressed-tensors: weight strategy {strategy!r} is not "
                                    f"supported (channel, group)")
        gs = int(w.get("group_size") or -1) if strategy == "group" else -1
        order = w.get("actorder")
        if order not in (None, "group", "weight", False):
            raise QuantizationError(f"compressed-tensors: actorder {order!r} is not supported")
        return QuantConfig("compressed-tensors", "ct-pack" if fmt == "pack-quantized" else "ct-int",
                           bits, _group(gs, "compressed-tensors"), bool(w.get("symmetric", True)),
                           order == "group", ignore=ignore)
    raise QuantizationError(f"compressed-tensors: format {fmt!r} with {kind}{bits} weights is not "
                            f"supported (float-quantized fp8, pack-quantized int4/int8, "
                            f"int-quantized int8)")


_CHECKPOINT = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}


def resolve(model_dir: str | pathlib.Path, requested: str | None) -> QuantConfig | None:
    """The scheme to load ``model_dir`` with (None: unquantized)."""
    if requested is not None and requested not in METHODS:
        raise QuantizationError(f"--quantization {requested!r} is not supported; choose from {METHODS}")
    raw = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    q = raw.get("quantization_config")
    if not q:
        if requested in ("fp8", "int8"):
            return QuantConfig(requested, "online")
        if requested is not None:
            raise QuantizationError(f"--quantization {requested} needs a checkpoint quantized "
                                    f"with it (config.json has no quantization_config)")
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in _CHECKPOINT:
        raise QuantizationError(f"quantization method {method!r} of the checkpoint is not "
                                f"supported; supported: {tuple(_CHECKPOINT)}")
    if requested is not None and requested != method:
        raise QuantizationError(f"--quantization {requested} does not match the checkpoint's "
                                f"quantization method {method!r}")
    return _CHECKPOINT[method](q)
