"""Builds a data plane worker: reads the checkpoint, sizes and allocates the KV cache, and
answers ``Describe``."""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from dataplane import kv_cache
from dataplane.config import ModelConfig, load_model_config
from dataplane.loader import load_model
from dataplane.runner import ModelRunner
from headrace.dataplane.v1 import worker_pb2 as pb

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclasses.dataclass
class WorkerOptions:
    model: str
    device: str = "cpu"
    dtype: str | None = None          # default: fp32 on CPU, bf16 on CUDA
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # default: sized from memory
    cpu_kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    seed: int = 0


class Worker:
    def __init__(self, opts: WorkerOptions, rank: int = 0, world_size: int = 1):
        self.opts = opts
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(opts.device)
        dtype_name = opts.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        if dtype_name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; choose from {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype_name]
        torch.manual_seed(opts.seed)
        self.cfg: ModelConfig = load_model_config(opts.model)
        self.max_model_len = opts.max_model_len or self.cfg.max_position_embeddings
        model = load_model(pathlib.Path(opts.model), self.cfg, self.device, self.dtype,
                           self.max_model_len)
        self.block_bytes = kv_cache.bytes_per_block(self.cfg, opts.block_size, self.dtype)
        num_blocks = opts.num_kv_blocks or self._blocks_from_memory()
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache")
        caches = kv_cache.allocate(self.cfg, num_blocks, opts.block_size, self.dtype, self.device)
        self.runner = ModelRunner(model, caches, opts.block_size, self.device, self.max_model_len)

    def _blocks_from_memory(self) -> int:
        # Activation reserve until warm-up measurement lands: hidden states and logits of a
        # max-length prefill, generously counted.
        cfg = self.cfg
        per_token = 4 * (8 * cfg.hidden_size + 2 * cfg.intermediate_size)
        reserve = self.max_model_len * per_token + 64 * cfg.vocab_size * 4
        budget = kv_cache.kv_budget_bytes(self.device, self.opts.cpu_kv_cache_gib,
                                          self.opts.gpu_memory_utilization, reserve)
        return budget // self.block_bytes

    def describe(self) -> pb.WorkerInfo:
        cfg = self.cfg
        return pb.WorkerInfo(
            model_name=cfg.name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), rank=self.rank, world_size=self.world_size,
            block_size=self.opts.block_size, num_kv_blocks=self.runner.num_blocks,
            kv_bytes_per_block=self.block_bytes, eos_token_ids=list(cfg.eos_token_ids))
