"""Sizes and allocates the paged KV cache: one ``[2, blocks, block_size, kv_heads, head_dim]``
tensor per layer."""

from __future__ import annotations

import torch

from headrace.dataplane.config import ModelConfig

GiB = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def available_host_bytes() -> int:
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
    return min(int(cpu_kv_gib * GiB), available_host_bytes() // 2)


def allocate(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device, progress=None) -> list[torch.Tensor]:
    """One zeroed tensor per layer (an FP8 cache must hold no NaN, even in slots never written:
    ``headrace.kernels.kv_layout``); ``progress`` (a ``headrace.dataplane.progress.Progress``)
    counts layers."""
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = []
    for _ in range(cfg.num_layers):
        caches.append(torch.zeros(shape, dtype=dtype, device=device))
        if progress is not None:
            progress.update()
    return caches
