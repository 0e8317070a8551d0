"""Multi-LoRA serving on the data plane (``--enable-lora``): many fine-tunes of the served model,
mixed in one batch. ``adapter`` reads a PEFT adapter (this rank's shard, checked against the
model), ``slots`` holds the device slots and the host cache, ``batch`` says which slot each
token of a step uses, ``layers`` applies the update in the model's projections, and
``graphs`` gives the CUDA graphs a variant with the LoRA kernels and one without.

The control plane (``headrace.controlplane.lora.registry``) owns which adapter each sequence uses and which slot
holds it; the worker follows: ``LoadAdapter`` fills its host cache, a step's ``lora_loads``
fill slots, a new sequence's ``lora_slot`` says which slot its tokens use.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from headrace.dataplane.config import ModelConfig
from headrace.dataplane.lora import adapter as adapters
from headrace.dataplane.lora.batch import LoraBatch
from headrace.dataplane.lora.layers import install
from headrace.dataplane.lora.slots import LoraSlots

log = logging.getLogger("headrace.dataplane")
MAX_RANK = 512


@dataclasses.dataclass
class LoraRuntime:
    slots: LoraSlots
    batch: LoraBatch

    def read(self, request, model: ModelConfig, shard):
        """``Worker.LoadAdapter``: the adapter of ``request`` read (this rank's shard, checked:
        ``adapter.AdapterError``) into the host cache; its ``LoadAdapterResponse``."""
        from headrace.worker.v1 import worker_pb2 as pb

        start = time.perf_counter()
        adapter = adapters.load(request.path, model, shard, self.slots.max_rank, self.slots.dtype)
        self.slots.cache(request.adapter_id, adapter)
        seconds = time.perf_counter() - start
        log.info("LoRA adapter %s cached as %d: rank %d, %.1f MiB, %.3fs", request.path,
                 request.adapter_id, adapter.rank, adapter.num_bytes / 2**20, seconds)
        return pb.LoadAdapterResponse(rank=adapter.rank, fingerprint=adapter.fingerprint,
                                      bytes=adapter.num_bytes, seconds=seconds)

    def every_token(self, n: int) -> None:
        """The warm-up's step: its ``n`` tokens all of slot 0 (the kernels compiled, their
        memory counted)."""
        import numpy as np

        from headrace.dataplane.lora.batch import plan

        step = plan(np.zeros(n, dtype=np.int64), self.batch.num_slots, self.batch.max_tokens)
        self.batch.begin(step, torch.from_numpy(step.array).to(self.slots.device))

    def describe_into(self, info) -> None:
        """The capacity ``WorkerInfo`` reports."""
        s = self.slots
        info.max_loras, info.max_lora_rank, info.max_cpu_loras = s.max_loras, s.max_rank, s.max_cpu_loras
        info.lora_slot_bytes = s.slot_bytes

    def describe(self) -> str:
        s = self.slots
        return (f"LoRA: {s.max_loras} slots of rank {s.max_rank} ({s.slot_bytes / 2**20:.1f} MiB "
                f"each on this rank), {s.max_cpu_loras} adapters in host memory")


def check_options(opts) -> None:
    """ValueError naming the flag when the LoRA options do not fit (``WorkerOptions``)."""
    if not opts.enable_lora:
        return
    if opts.max_loras < 1:
        raise ValueError(f"--max-loras {opts.max_loras}: must be >= 1")
    if not 1 <= opts.max_lora_rank <= MAX_RANK:
        raise ValueError(f"--max-lora-rank {opts.max_lora_rank}: must be in [1, {MAX_RANK}]")
    if opts.max_cpu_loras is not None and opts.max_cpu_loras < opts.max_loras:
        raise ValueError(f"--max-cpu-loras {opts.max_cpu_loras}: must be >= --max-loras "
                         f"({opts.max_loras})")


def enable(model: torch.nn.Module, local: ModelConfig, opts, dtype: torch.dtype,
           device: torch.device, max_tokens: int) -> LoraRuntime:
    """Allocates the slots and the step buffer and wraps the model's projections."""
    slots = LoraSlots(local, opts.max_loras, opts.max_lora_rank,
                      opts.max_cpu_loras or opts.max_loras, dtype, device)
    batch = LoraBatch(opts.max_loras, max_tokens, device, slots)
    install(model, slots, batch)
    return LoraRuntime(slots, batch)
