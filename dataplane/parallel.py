"""Tensor parallelism: the process group of one worker group, its collectives and the shard
arithmetic (which heads, KV heads, MLP columns and vocabulary rows each rank holds).

One process per rank; NCCL on CUDA, gloo on CPU. With one rank (or before ``init``) every
collective is a no-op, so the single-process path runs the same code. Query heads and the MLP
are split evenly; KV heads are split when there are at least as many as ranks, otherwise each
rank holds (a replica of) the one KV head its query heads attend with. The vocabulary is padded
to a multiple of the world size; each rank holds ``vocab_per_rank`` rows of the embedding and
LM head, and the logits are gathered across ranks before sampling.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from headrace import kernels
from headrace.dataplane.config import ModelConfig

DEFAULT_TIMEOUT_S = 300.0


def init(rank: int, world_size: int, init_method: str, device: torch.device,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Joins the worker group's process group (no-op for one rank). ``timeout_s`` bounds both
    the rendezvous and every collective, so a dead rank fails steps instead of hanging them."""
    if world_size <= 1 or dist.is_initialized():
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` across ranks in place (row-parallel layers' partial products). Under
    ``--deterministic`` with more than two ranks, the partials are gathered and added in rank
    order: NCCL picks its algorithm (ring, tree) and chunking by message size, i.e. by batch,
    and with three or more terms the order changes the rounding (two terms add alike either
    way)."""
    n = world_size()
    if n > 2 and kernels.batch_invariant.ENABLED:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return x.copy_(total)
    if n > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's ``x`` along the last dimension, in rank order."""
    n = world_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrites ``x`` on every rank with rank ``src``'s."""
    if world_size() > 1:
        dist.broadcast(x, src)
    return x


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one rank of ``world`` holds of a model."""

    rank: int
    world: int
    num_heads: int          # local query heads
    num_kv_heads: int       # local KV heads (1 replica when there are fewer KV heads than ranks)
    kv_head_start: int      # first global KV head held
    intermediate_size: int  # local MLP columns
    vocab_size: int         # the model's true vocabulary
    vocab_per_rank: int     # local embedding / LM head rows (vocab padded to a multiple of world)

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows this rank holds."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, world: int = 1) -> "Shard":
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        if heads % world:
            raise ValueError(f"{heads} attention heads do not split over {world} ranks")
        if cfg.intermediate_size % world:
            raise ValueError(f"intermediate size {cfg.intermediate_size} does not split over {world} ranks")
        if kv >= world:
            if kv % world:
                raise ValueError(f"{kv} KV heads do not split over {world} ranks")
            kv_local, kv_start = kv // world, rank * (kv // world)
        else:
            if world % kv:
                raise ValueError(f"{world} ranks are not a multiple of {kv} KV heads")
            kv_local, kv_start = 1, rank * kv // world
        return cls(rank=rank, world=world, num_heads=heads // world, num_kv_heads=kv_local,
                   kv_head_start=kv_start, intermediate_size=cfg.intermediate_size // world,
                   vocab_size=cfg.vocab_size, vocab_per_rank=-(-cfg.vocab_size // world))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts and MLP width (what its layers and KV cache hold)."""
        return dataclasses.replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)


def merged_part(cfg: ModelConfig, shard: Shard, merged: str, index: int):
    """(checkpoint size, source start, rows, destination start) of part ``index`` of a merged
    projection on ``shard``'s rank: each rank's qkv_proj holds [its q rows, its k rows, its v
    rows] (index 0, 1, 2); gate_up_proj [gate, up] (0, 1). The loaders of dense and quantized
    checkpoints (and of adapters) cut the checkpoint's rows by it."""
    hd = cfg.head_dim
    if merged == "qkv_proj":
        q, kv = shard.num_heads * hd, shard.num_kv_heads * hd
        if index == 0:
            return cfg.q_size, shard.head_start * hd, q, 0
        return cfg.kv_size, shard.kv_head_start * hd, kv, q + (index - 1) * kv
    i = shard.intermediate_size
    return cfg.intermediate_size, shard.rank * i, i, index * i
