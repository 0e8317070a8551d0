"""Writes a compressed-tensors W4A16 (pack-quantized, int4, group 128, symmetric) copy of a float
checkpoint, round-to-nearest, tensor by tensor with compressed-tensors' own quantiser and packer:
an INT4 checkpoint for the GPU benchmarks (W2's single-stream ITL) from bench/random_checkpoint.py's.

    python bench/quantize_checkpoint.py /tmp/llama8b /tmp/llama8b-w4a16 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=pathlib.Path)
    ap.add_argument("dst", type=pathlib.Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = args.group_size
    wargs = scheme.weights
    args.dst.mkdir(parents=True, exist_ok=True)
    for f in args.src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, args.dst / f.name)
    for path in sorted(args.src.glob("*.safetensors")):
        out = {}
        with safe_open(str(path), framework="pt", device=args.device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                parts = name.split(".")
                if len(parts) < 3 or parts[-2] not in PROJS or parts[-1] != "weight":
                    out[name] = t
                    continue
                w = t.float()
                if w.shape[1] % args.group_size:
                    raise SystemExit(f"{name}: input size {w.shape[1]} is not a multiple of "
                                     f"--group-size {args.group_size}")
                grouped = w.reshape(w.shape[0], -1, args.group_size)
                scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), wargs)
                q = quantize(x=w, scale=scale, zero_point=zp, args=wargs, dtype=torch.int8)
                prefix = name[:-len("weight")]
                out[prefix + "weight_packed"] = pack_to_int32(q, 4).cpu()
                out[prefix + "weight_scale"] = scale.to(t.dtype).cpu()
                out[prefix + "weight_shape"] = torch.tensor(list(w.shape))
        save_file({k: v.contiguous().cpu() for k, v in out.items()}, str(args.dst / path.name))
        print(f"{path.name}: {sum(1 for k in out if k.endswith('weight_packed'))} projections packed")
    cfg = json.loads((args.src / "config.json").read_text())
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                              format="pack-quantized", quantization_status="compressed")
    cfg["quantization_config"] = {**qcfg.model_dump(), "quant_method": "compressed-tensors"}
    (args.dst / "config.json").write_text(json.dumps(cfg, indent=2))
    index = args.src / "model.safetensors.index.json"
    if index.exists():   # tensor names changed: rewrite the weight map
        idx = json.loads(index.read_text())
        weight_map = {}
        for name, file in idx["weight_map"].items():
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in PROJS and parts[-1] == "weight":
                for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                    weight_map[name[:-len("weight")] + suffix] = file
            else:
                weight_map[name] = file
        idx["weight_map"] = weight_map
        (args.dst / index.name).write_text(json.dumps(idx, indent=2))


if __name__ == "__main__":
    main()
