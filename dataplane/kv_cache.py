"""Sizes and allocates the paged KV cache: one ``[2, blocks, block_size, kv_heads, head_dim]``
tensor per layer.

That is the logical shape every kernel indexes (through strides). In memory the cache is
head-major, ``[2, blocks, kv_heads, block_size, head_dim]`` seen through a transposed view: one
block of one KV head is one contiguous run (block_size x head_dim), so attention, which reads
one head per program, streams whole runs instead of head_dim-sized pieces a row apart.
"""

from __future__ import annotations

import os

import torch

from dataplane.config import ModelConfig

GiB = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB


def host_budget_bytes(cpu_kv_gib: float) -> int:
    """KV bytes on the CPU: ``cpu_kv_gib``, capped at half of the host's available memory."""
    return min(int(cpu_kv_gib * GiB), _available_host_bytes() // 2)


def allocate(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
    if os.environ.get("HEADRACE_KV_LAYOUT") == "slot":   # A/B switch for the measurement
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    shape = (2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
            for _ in range(cfg.num_layers)]
