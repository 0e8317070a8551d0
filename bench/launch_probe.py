"""Probe (GPU only, not a test): host microseconds to launch each op of an eager prefill step
(8,192 tokens of Qwen3-0.6B), measured while the device is kept busy so the host never waits
for it; the eager (non-graph) steps of a workload pay these per layer.

    python -P bench/launch_probe.py
"""

from __future__ import annotations

import time

import torch

import kernels

N, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8192, 1024, 16, 8, 128


def host_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    busy = torch.empty(1 << 28, device="cuda")    # ~1 GiB of work queued ahead of the calls
    for _ in range(20):
        busy.mul_(1.0)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@torch.inference_mode()
def main() -> None:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(N, HIDDEN, dtype=bf16, device=dev)
    w_qkv = torch.randn(4096, HIDDEN, dtype=bf16, device=dev)
    w_norm = torch.ones(HIDDEN, dtype=bf16, device=dev)
    gate_up = torch.randn(N, 6144, dtype=bf16, device=dev)
    print("op                         host_us/launch")
    rows = {
        "torch linear (cuBLAS)": lambda: torch.nn.functional.linear(x, w_qkv),
        "kernels.linear": lambda: kernels.linear(x, w_qkv),
        "torch.mm": lambda: torch.mm(x, w_qkv.t()),
        "fused_add_rms_norm": lambda: kernels.fused_add_rms_norm(x, x, w_norm, 1e-6),
        "silu_and_mul": lambda: kernels.silu_and_mul(gate_up),
        "torch add": lambda: x + x,
        "torch.empty": lambda: torch.empty(N, HIDDEN, dtype=bf16, device=dev),
    }
    for name, fn in rows.items():
        print(f"{name:26s} {host_us(fn):10.1f}")


if __name__ == "__main__":
    main()
