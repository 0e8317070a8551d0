"""Loading quantized checkpoints: scheme detection and its errors, every format's loader against
the checkpoint writer's own dequantised weights and logits, tensor-parallel shards, FP8 KV."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from headrace.dataplane import kv_cache
from headrace.dataplane.config import load_model_config
from headrace.dataplane.loader import load_model
from headrace.dataplane.model import AttentionMetadata
from headrace.dataplane.parallel import Shard
from headrace.dataplane.quantization import QuantizationError, resolve
from headrace.dataplane.quantization.layers import Fp8Linear, WNA16Linear
from headrace.kernels import kv_layout, reference_quant
from tests import quant_checkpoints as qc

IDS = [3, 17, 200, 45, 9, 310, 77, 5, 120, 64, 33, 250, 8, 199, 42, 2]


def forward_logits(model, ids, kv_dtype=torch.float32, keep: list | None = None):
    """Logits of every position of one prefill over a fresh paged cache (its per-layer tensors
    appended to ``keep`` when given)."""
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    caches = kv_cache.allocate(model.cfg, blocks, bs, kv_dtype, torch.device("cpu"))
    if keep is not None:
        keep.extend(caches)
    meta = AttentionMetadata(slot_mapping=torch.arange(n),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None])
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def load(path, method=None, shard=None):
    cfg = load_model_config(path)
    return load_model(path, cfg, torch.device("cpu"), torch.float32, 256, shard,
                      resolve(path, method))


def hf_logits(ref, ids=IDS):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def dense(layer) -> torch.Tensor:
    """The dequantised [out, in] weight a quantized layer multiplies by."""
    if isinstance(layer, Fp8Linear):
        return layer.weight.float() * layer.weight_scale[:, None]
    w = reference_quant.dequantize_wna16(layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                                         layer.bits, torch.float32)
    if layer.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, layer.perm] = w
    return out


def check_weights(model, ref):
    """Every merged projection's dequantised weight equals the writer's, part by part."""
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        a, m = ref_layer.self_attn, ref_layer.mlp
        pairs = [(layer.self_attn.qkv_proj, torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                        a.v_proj.weight])),
                 (layer.self_attn.o_proj, a.o_proj.weight),
                 (layer.mlp.gate_up_proj, torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                 (layer.mlp.down_proj, m.down_proj.weight)]
        for ours, theirs in pairs:
            assert isinstance(ours, (Fp8Linear, WNA16Linear))
            torch.testing.assert_close(dense(ours), theirs.detach().float(), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- detection


def _config(tmp_path, q):
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if q is not None:
        cfg["quantization_config"] = q
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("q,flag,message", [
    ({"quant_method": "bitsandbytes"}, None, "'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, None, "group size 100"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None, "'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "weight_block_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", "does not match"),
    (None, "gptq", "no quantization_config"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}}},
     None, "quantized input activations"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, None, "'tensor'"),
])
def test_unsupported_schemes_fail_naming_what(tmp_path, q, flag, message):
    with pytest.raises(QuantizationError, match=message):
        resolve(_config(tmp_path, q), flag)


def test_detection(tmp_path):
    assert resolve(_config(tmp_path, None), None) is None
    assert resolve(_config(tmp_path, None), "fp8").fmt == "online"
    g = resolve(_config(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "desc_act": True, "sym": False}), "gptq")
    assert (g.bits, g.group_size, g.desc_act, g.sym, g.zero_offset) == (4, 128, True, False, 1)
    a = resolve(_config(tmp_path, {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                   "zero_point": True, "version": "GEMM"}), None)
    assert (a.fmt, a.group_size, a.sym) == ("awq", 64, False)
    f = resolve(_config(tmp_path, {"quant_method": "fp8", "activation_scheme": "static"}), None)
    assert f.fp8 and f.static_input


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("preset,fmt,group,static", [
    ("FP8", "float-quantized", 0, 0.05),          # per-tensor weights, static activations
    ("FP8_DYNAMIC", "float-quantized", 0, None),  # per-channel weights, dynamic per token
    ("W4A16", "pack-quantized", 32, None),
    ("W4A16_ASYM", "pack-quantized", 64, None),
    ("W8A16", "pack-quantized", 0, None),          # per-channel int8, packed 4 per int32
])
def test_compressed_tensors_checkpoints(tmp_path, preset, fmt, group, static):
    path, ref = qc.compressed_tensors_checkpoint(tmp_path, preset, fmt, group, static)
    model = load(path, "compressed-tensors" if group else None)
    check_weights(model, ref)
    # the reference quantises the FP8 schemes' activations with compressed-tensors' own code
    torch.testing.assert_close(forward_logits(model, IDS), hf_logits(ref), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("bits,group,sym,act_order,v1", [
    (4, 32, True, False, True), (4, 128, False, True, True), (4, -1, False, False, False),
    (8, 64, True, True, True)])
def test_gptq_checkpoints(tmp_path, bits, group, sym, act_order, v1):
    path, ref = qc.packed_checkpoint(tmp_path, "gptq", bits=bits, group_size=group, sym=sym,
                                     act_order=act_order, v1=v1)
    model = load(path, "gptq")
    check_weights(model, ref)
    torch.testing.assert_close(forward_logits(model, IDS), hf_logits(ref), atol=2e-4, rtol=2e-4)


def test_awq_checkpoint(tmp_path):
    path, ref = qc.packed_checkpoint(tmp_path, "awq", group_size=32)
    model = load(path)
    check_weights(model, ref)
    torch.testing.assert_close(forward_logits(model, IDS), hf_logits(ref), atol=2e-4, rtol=2e-4)


def test_shape_mismatch_fails_loudly(tmp_path):
    path, _ = qc.packed_checkpoint(tmp_path, "gptq", group_size=32)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64    # the scales say 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=r"scales: checkpoint shape \(4, 128\)"):
        load(path)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization(tmp_path, method):
    """--quantization int8 / fp8 on a float checkpoint: per-channel round-to-nearest weights
    (computed here independently), FP8 activations per token (compressed-tensors' quantiser on
    the reference); the LM head stays unquantized."""
    from compressed_tensors.quantization import preset_name_to_scheme

    src, ref = qc.float_model(tmp_path)
    for name, mod in ref.named_modules():
        if name.split(".")[-1] in qc.PROJS:
            w = mod.weight.detach()
            if method == "int8":
                s = w.abs().amax(1, keepdim=True) / 127
                mod.weight.data = torch.round(w / s).clamp(-128, 127) * s
            else:
                s = w.abs().amax(1, keepdim=True) / 448
                mod.weight.data = (w / s).to(torch.float8_e4m3fn).float() * s
                qc._fake_quantize_inputs(mod, preset_name_to_scheme(
                    "FP8_DYNAMIC", ["Linear"]).input_activations, None)
    model = load(src, method)
    check_weights(model, ref)
    assert isinstance(model.lm_head, torch.nn.Linear)   # the LM head stays unquantized
    torch.testing.assert_close(forward_logits(model, IDS), hf_logits(ref), atol=2e-4, rtol=2e-4)


# ----------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("kind", ["gptq-act-order", "awq", "ct-fp8"])
def test_tensor_parallel_shards_recombine(tmp_path, kind):
    """Two ranks' shards of every projection recombine to the whole layer: column-parallel
    weights concatenate (per merged part) along rows, row-parallel ones along columns and their
    partial products sum; a row-parallel act-order shard has ragged groups (the g_idx path of
    the kernels) and keeps the whole scale table."""
    if kind == "gptq-act-order":
        path, _ = qc.packed_checkpoint(tmp_path, "gptq", group_size=32, act_order=True, sym=False,
                                       heads=4, kv_heads=2, head_dim=32)
    elif kind == "awq":
        path, _ = qc.packed_checkpoint(tmp_path, "awq", group_size=32)
    else:
        path, _ = qc.compressed_tensors_checkpoint(tmp_path, "FP8_DYNAMIC", "float-quantized")
    cfg = load_model_config(path)
    whole = load(path)
    ranks = [load(path, shard=Shard.of(cfg, r, 2)) for r in range(2)]
    torch.manual_seed(0)
    for li in range(cfg.num_layers):
        layers = [m.model.layers[li] for m in [whole] + ranks]
        full = dense(layers[0].self_attn.qkv_proj).split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        shards = [dense(lay.self_attn.qkv_proj) for lay in layers[1:]]
        local = ranks[0].cfg
        for part, size in enumerate([local.q_size, local.kv_size, local.kv_size]):
            start = [0, local.q_size, local.q_size + local.kv_size][part]
            torch.testing.assert_close(torch.cat([s[start:start + size] for s in shards]),
                                       full[part])
        for name, width in (("o_proj", local.q_size), ("down_proj", local.intermediate_size)):
            parent = "self_attn" if name == "o_proj" else "mlp"
            mods = [getattr(getattr(lay, parent), name) for lay in layers]
            xin = torch.randn(3, 2 * width)
            torch.testing.assert_close(torch.cat([dense(m) for m in mods[1:]], 1), dense(mods[0]))
            if kind != "ct-fp8":   # FP8 activation scales are per rank's slice (as vLLM's)
                partial = sum(m.matmul(xin[:, r * width:(r + 1) * width], None)
                              for r, m in enumerate(mods[1:]))
                torch.testing.assert_close(partial, mods[0](xin), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- FP8 KV cache


def test_checkpoint_kv_scales_serve_the_fp8_cache(tmp_path):
    """k_scale / v_scale (vLLM's and compressed-tensors' names, and the older k_proj /
    v_proj.output_scale) land on the attention layers, and the FP8 cache stores k / k_scale:
    layer 0's cache (its inputs do not depend on the cache) is the float run's divided by the
    scales, in e4m3; the logits stay near the float cache's."""
    from safetensors.torch import load_file, save_file

    src, _ = qc.float_model(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.2)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.1)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.3])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.15])
    save_file(tensors, str(src / "model.safetensors"))
    model = load(src)
    scales = [s for layer in model.model.layers for s in (layer.self_attn.k_scale,
                                                           layer.self_attn.v_scale)]
    assert scales == pytest.approx([0.2, 0.1, 0.3, 0.15])
    caches = {}
    logits = {dt: forward_logits(model, IDS, dt, caches.setdefault(dt, []))
              for dt in (torch.float32, torch.float8_e4m3fn)}
    expect = reference_quant.to_fp8(caches[torch.float32][0] / torch.tensor([0.2, 0.1]).view(
        2, 1, 1, 1, 1))
    assert torch.equal(kv_layout.logical(caches[torch.float8_e4m3fn][0]).float(), expect.float())
    base, fp8 = logits[torch.float32], logits[torch.float8_e4m3fn]
    assert (fp8.argmax(-1) == base.argmax(-1)).float().mean() >= 0.6   # a random model: fragile


@pytest.mark.slow   # quantizes a checkpoint in a subprocess
def test_bench_quantize_checkpoint_writes_a_loadable_w4a16_copy(tmp_path):
    """bench/quantize_checkpoint.py (the GPU benchmarks' INT4 checkpoint): every projection
    round-to-nearest within half a quantisation step of the float weight."""
    import subprocess
    import sys

    src, ref = qc.float_model(tmp_path / "float")
    subprocess.run([sys.executable, "-m", "bench.quantize_checkpoint", str(src), str(tmp_path / "q")],
                   check=True, capture_output=True, cwd=pathlib.Path(__file__).resolve().parents[1])
    model = load(tmp_path / "q", "compressed-tensors")
    layer, ref_layer = model.model.layers[1], ref.model.layers[1]
    w = ref_layer.mlp.down_proj.weight.detach()
    step = w.reshape(w.shape[0], -1, 128).abs().amax(-1) / 7.5     # symmetric int4: 15 steps
    err = (dense(layer.mlp.down_proj) - w).abs().reshape(w.shape[0], -1, 128)
    assert isinstance(layer.mlp.down_proj, WNA16Linear)
    assert (err <= step[..., None] / 2 + 1e-6).all()
