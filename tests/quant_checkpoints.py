"""Quantized tiny checkpoints for the loader tests, each with its dequantised reference model.

* compressed-tensors (float-quantized FP8, pack-quantized INT4/INT8, int-quantized INT8): written
  by the ``compressed-tensors`` library itself (its quantization config, ``calculate_qparams``,
  ``fake_quantize`` for the reference weights and ``ModelCompressor`` to pack and save).
* GPTQ and AWQ: GPTQModel / AutoAWQ are not installable here (they build CUDA extensions), so
  these are packed by the independent packers below, written from the published layouts (GPTQ's
  ``QuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear``, as loops over int32 words
  with numpy), not with the data plane's code.

Every writer returns (checkpoint dir, reference HF model whose projections hold the dequantised
weights).
"""

from __future__ import annotations

import copy
import json
import pathlib

import numpy as np
import torch

from tests.checkpoints import make_checkpoint

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "mlp",
            "up_proj": "mlp", "down_proj": "down"}
SHARED_INPUT = ("qkv", "o", "mlp", "down")


def float_model(path: pathlib.Path, src: pathlib.Path | None = None, **opts):
    """(checkpoint dir, its HF model in float32): ``src``, or a new tiny random Llama."""
    import transformers

    src = src or make_checkpoint(path, "llama", **opts)
    return src, transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)


def compressed_tensors_checkpoint(path: pathlib.Path, preset: str, fmt: str, group_size: int = 0,
                                  static_input: float | None = None, src=None, **opts):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    src, model = float_model(path / "float", src, **opts)
    ref = copy.deepcopy(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size == -1:   # one group per output channel
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    elif group_size:
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    ref_modules = dict(ref.named_modules())
    for name, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        args, w = m.quantization_scheme.weights, m.weight.detach()
        if args.strategy == "group":
            grouped = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, args)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zp.to(m.weight_zero_point.dtype).reshape(
                m.weight_zero_point.shape)
        if static_input is not None and hasattr(m, "input_scale"):
            m.input_scale.data = torch.full_like(m.input_scale, static_input)
        ref_modules[name].weight.data = fake_quantize(w, m.weight_scale,
                                                      getattr(m, "weight_zero_point", None), args)
        if scheme.input_activations is not None:   # FP8 W8A8: the activations too
            _fake_quantize_inputs(ref_modules[name], scheme.input_activations,
                                  None if static_input is None else m.input_scale.detach().clone())
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    out = path / "quantized"
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_tokenizer(src, out)
    return out, ref


def _fake_quantize_inputs(module, args, static_scale) -> None:
    """compressed-tensors' own activation quantisation (per token, or one static scale) on the
    reference model's inputs to ``module``."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def hook(mod, inputs):
        x = inputs[0]
        scale = static_scale
        if scale is None:
            scale, _ = compute_dynamic_scales_and_zp(x, args, mod)
        return (fake_quantize(x, scale, None, args),)

    module.register_forward_pre_hook(hook)


def _copy_tokenizer(src: pathlib.Path, dst: pathlib.Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def _quantize_groups(w: np.ndarray, bits: int, group_size: int, sym: bool, g_idx: np.ndarray):
    """Round-to-nearest per group: (int values [out, in], scales [G, out], zeros [G, out])."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = np.zeros((groups, w.shape[0]), np.float32)
    zeros = np.zeros((groups, w.shape[0]), np.int64)
    q = np.zeros(w.shape, np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        lo = np.minimum(w[:, cols].min(1), 0)
        hi = np.maximum(w[:, cols].max(1), 0)
        if sym:
            amax = np.maximum(np.abs(lo), hi)
            s = np.maximum(2 * amax / maxq, 1e-8)
            z = np.full(w.shape[0], (maxq + 1) // 2)
        else:
            s = np.maximum((hi - lo) / maxq, 1e-8)
            z = np.clip(np.round(-lo / s), 0, maxq).astype(np.int64)
        s = s.astype(np.float16).astype(np.float32)     # checkpoints hold fp16 scales
        scales[g], zeros[g] = s, z
        q[:, cols] = np.clip(np.round(w[:, cols] / s[:, None]) + z[:, None], 0, maxq)
    return q, scales, zeros


def gptq_tensors(w: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool,
                 v1: bool, seed: int):
    """GPTQ's layout for one weight [out, in]; returns (tensors, dequantised weight)."""
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    if act_order:   # GPTQ orders columns by its Hessian; any permutation makes the layout
        perm = np.random.default_rng(seed).permutation(in_f)
        g_idx = np.zeros(in_f, np.int64)
        g_idx[perm] = np.arange(in_f) // gs
    else:
        g_idx = np.arange(in_f) // gs
    q, scales, zeros = _quantize_groups(w.double().numpy(), bits, gs, sym, g_idx)
    per = 32 // bits
    qweight = np.zeros((in_f // per, out_f), np.uint32)
    for row in range(in_f // per):            # QuantLinear.pack: rows of the transposed weight
        for j in range(per):
            qweight[row] |= q[:, row * per + j].astype(np.uint32) << np.uint32(bits * j)
    stored = (zeros - 1) % (1 << bits) if v1 else zeros   # v1 checkpoints store zero - 1
    qzeros = np.zeros((zeros.shape[0], out_f // per), np.uint32)
    for col in range(out_f // per):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j].astype(np.uint32) << np.uint32(bits * j)
    dense = (q - zeros[g_idx].T) * scales[g_idx].T
    tensors = {"qweight": torch.from_numpy(qweight.view(np.int32)),
               "qzeros": torch.from_numpy(qzeros.view(np.int32)),
               "scales": torch.from_numpy(scales).half(),
               "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return tensors, torch.from_numpy(dense).float()


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_tensors(w: torch.Tensor, group_size: int, seed: int):
    """AutoAWQ's GEMM layout (asymmetric int4) for one weight [out, in]."""
    out_f, in_f = w.shape
    g_idx = np.arange(in_f) // group_size
    q, scales, zeros = _quantize_groups(w.double().numpy(), 4, group_size, False, g_idx)
    intweight = q.T                                     # [in, out]
    qweight = np.zeros((in_f, out_f // 8), np.uint32)
    qzeros = np.zeros((zeros.shape[0], out_f // 8), np.uint32)
    for col in range(out_f // 8):                       # WQLinear_GEMM.from_linear
        for i in range(8):
            src = col * 8 + AWQ_PACK_ORDER[i]
            qweight[:, col] |= intweight[:, src].astype(np.uint32) << np.uint32(i * 4)
            qzeros[:, col] |= zeros[:, src].astype(np.uint32) << np.uint32(i * 4)
    dense = (q - zeros[g_idx].T) * scales[g_idx].T
    tensors = {"qweight": torch.from_numpy(qweight.view(np.int32)),
               "qzeros": torch.from_numpy(qzeros.view(np.int32)),
               "scales": torch.from_numpy(scales).half()}
    return tensors, torch.from_numpy(dense).float()


def packed_checkpoint(path: pathlib.Path, method: str, *, bits: int = 4, group_size: int = 32,
                      sym: bool = True, act_order: bool = False, v1: bool = True, src=None,
                      **opts):
    """A GPTQ or AWQ checkpoint of a tiny random Llama (every projection quantized)."""
    from safetensors.torch import save_file

    src, ref = float_model(path / "float", src, **opts)
    tensors = {}
    for name, param in ref.state_dict().items():
        if name == "lm_head.weight" and ref.config.tie_word_embeddings:
            continue
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in PROJS and parts[-1] == "weight":
            prefix = ".".join(parts[:-1])
            # act order permutes by the layer input's Hessian: q/k/v (and gate/up) share it
            seed = int(parts[2]) * 10 + SHARED_INPUT.index(INPUT_OF[parts[-2]])
            if method == "gptq":
                q, dense = gptq_tensors(param, bits, group_size, sym, act_order, v1, seed)
            else:
                q, dense = awq_tensors(param, group_size, seed)
            tensors.update({f"{prefix}.{k}": v for k, v in q.items()})
            param.copy_(dense)
        else:
            tensors[name] = param.clone().contiguous()
    out = path / "quantized"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                      "sym": sym, "desc_act": act_order,
                                      "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg))
    _copy_tokenizer(src, out)
    return out, ref
