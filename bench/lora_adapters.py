"""Writes random LoRA adapters in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``)
for a checkpoint, from its ``config.json`` alone (no model is loaded: an 8B model's adapters are
written in seconds each), for the LoRA benchmarks (``bench.lora_bench``).

    python -m bench.lora_adapters /tmp/qwen3 /tmp/qwen3-loras --count 8 --rank 16

Each adapter ``DIR/lora-<i>`` has LoRA on the targets (default all 7 projections of every
layer) at ``--rank``, ``lora_alpha`` twice the rank, A ~ N(0, 1/in) and B ~ N(0, ``--b-std``)
in bfloat16 (distinct seeds: distinct weights, so distinct prefix-cache keys); prints one JSON
line with their paths, bytes and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
from safetensors.torch import save_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config.get("num_key_value_heads", config["num_attention_heads"]) * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(model_dir: pathlib.Path, out: pathlib.Path, rank: int, seed: int,
                  targets=ALL, b_std: float = 0.02, dtype=torch.bfloat16) -> int:
    """One random adapter of ``model_dir`` in ``out``; returns its weights' bytes."""
    config = json.loads((model_dir / "config.json").read_text())
    dims = shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            k, n = dims[proj]
            key = f"base_model.model.model.layers.{layer}.{PARENT[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, k, generator=g) / k ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * b_std).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    arch = (config.get("architectures") or [""])[0]
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none", "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir), "inference_mode": True,
        "auto_mapping": {"base_model_class": arch} if arch else None}, indent=1))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_adapters(model_dir, out_dir, count: int, rank: int = 16, targets=ALL, seed: int = 0,
                   b_std: float = 0.02) -> list[str]:
    """``count`` adapters ``out_dir/lora-<i>`` (kept when already written with these options)."""
    model_dir, out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
    paths = []
    for i in range(count):
        path = out_dir / f"lora-{i}"
        stamp = path / ".made"
        want = json.dumps([rank, list(targets), seed + i, b_std, str(model_dir)])
        if not (stamp.exists() and stamp.read_text() == want):
            write_adapter(model_dir, path, rank, seed + i, targets, b_std)
            stamp.write_text(want)
        paths.append(str(path))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the checkpoint directory (its config.json is read)")
    ap.add_argument("out", help="where the adapters go (DIR/lora-<i>)")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(ALL), help="comma-separated projections")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--b-std", type=float, default=0.02, help="B's standard deviation")
    args = ap.parse_args()
    start = time.perf_counter()
    paths = write_adapters(args.model, args.out, args.count, args.rank, tuple(args.targets.split(",")),
                           args.seed, args.b_std)
    size = (pathlib.Path(paths[0]) / "adapter_model.safetensors").stat().st_size if paths else 0
    print(json.dumps({"adapters": paths, "bytes_each": size,
                      "seconds": round(time.perf_counter() - start, 2)}))


if __name__ == "__main__":
    main()
