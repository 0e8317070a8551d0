"""A worker's LoRA memory: ``--max-loras`` adapter slots on the device and a host cache of up to
``--max-cpu-loras`` adapters, laid out so that loading an adapter into a slot is one copy.

Layout: every projection that can carry LoRA (a ``Site``: each layer's merged q/k/v, o, merged
gate/up and down, with this rank's shapes) has an A [S x R, in] and a B [out, R] region in a
slot, R = ``--max-lora-rank``, S its slices (3, 1, 2, 1); an adapter of a smaller rank, or
without some projections, is zero-padded. A slot is one contiguous row of ``memory``
[slots, per_slot] in the model dtype, and each site's stacked buffers are strided views of it
([slots, S x R, in] and [slots, out, R], the kernels' ``lora_a`` / ``lora_b``), so the whole
adapter of a slot lands with one host-to-device copy from its host entry, which has the same
layout (pinned on CUDA: an 8B model's rank-16 adapter is ~84 MB, ~3-4 ms over PCIe 5).

The control plane decides everything (``headrace.controlplane.lora.registry``): ``cache`` puts an adapter read
from disk (``headrace.dataplane.lora.adapter``) in the host cache under the control plane's id, ``drop``
takes it out, and a step's ``load`` copies a cached adapter into a slot. On CUDA the copy runs
on a copy stream of its own after every op queued before it (a step still in flight may read
the slot's previous adapter: the control plane frees a slot once its last sequence finished,
before the steps that were sent meanwhile ran), and a step waits (a device-side wait) only
for the loads of the slots it reads. On the CPU the copy runs at once.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch

from headrace.dataplane.config import ModelConfig
from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.lora.adapter import Adapter

# merged projection -> the HF projections of its slices, in order
SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Site:
    """One LoRA-capable projection of this rank: its input width, its slices' output
    boundaries, and where its A and B sit in a slot (element offsets)."""

    layer: int
    merged: str
    in_features: int
    slices: tuple[int, ...]
    a_offset: int
    b_offset: int

    @property
    def num_slices(self) -> int:
        return len(self.slices) - 1


def sites_of(local: ModelConfig, rank: int) -> tuple[list[Site], int]:
    """Every site of a rank's model (``local``: its shard's config) and a slot's elements."""
    q, kv, i, h = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim, \
        local.intermediate_size, local.hidden_size
    shapes = {"qkv_proj": (h, (0, q, q + kv, q + 2 * kv)), "o_proj": (q, (0, h)),
              "gate_up_proj": (h, (0, i, 2 * i)), "down_proj": (i, (0, h))}
    sites, offset = [], 0
    for layer in range(local.num_layers):
        for merged, (k, slices) in shapes.items():
            a = (len(slices) - 1) * rank * k
            sites.append(Site(layer, merged, k, slices, offset, offset + a))
            offset += a + slices[-1] * rank
    return sites, offset


class LoraSlots:
    def __init__(self, local: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.sites, self.per_slot = sites_of(local, max_rank)
        self.memory = torch.zeros((max_loras, self.per_slot), dtype=dtype, device=device)
        self.host: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self.held: list[int | None] = [None] * max_loras   # the adapter id in each slot
        self._lock = threading.Lock()   # ``cache`` runs on an RPC thread, ``load`` on the steps'
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._pending: dict[int, torch.cuda.Event] = {}   # slot -> its load's event
        self.num_loads = 0
        self.load_seconds = 0.0   # host time of the loads' copies (CPU) / their queueing (CUDA)

    @property
    def slot_bytes(self) -> int:
        return self.per_slot * self.memory.element_size()

    def views(self, site: Site) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's stacked buffers: A [slots, S x R, in] and B [slots, out, R], views of
        ``memory`` (a slot's rows are contiguous, slots ``per_slot`` apart)."""
        r, s = self.max_rank, site.num_slices
        a = self.memory[:, site.a_offset:site.a_offset + s * r * site.in_features]
        b = self.memory[:, site.b_offset:site.b_offset + site.slices[-1] * r]
        return a.view(self.max_loras, s * r, site.in_features), b.view(self.max_loras, site.slices[-1], r)

    # -- the host cache -----------------------------------------------------------------------
    def pack(self, adapter: Adapter) -> torch.Tensor:
        """The adapter in a slot's layout, in host memory (pinned on CUDA)."""
        flat = torch.zeros(self.per_slot, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        r = self.max_rank
        for site in self.sites:
            projs = SLICES[site.merged]
            a = flat[site.a_offset:site.a_offset + len(projs) * r * site.in_features].view(
                len(projs) * r, site.in_features)
            b = flat[site.b_offset:site.b_offset + site.slices[-1] * r].view(site.slices[-1], r)
            for j, proj in enumerate(projs):
                pair = adapter.weights.get((site.layer, proj))
                if pair is None:
                    continue
                lora_a, lora_b = pair
                rank = lora_a.shape[0]
                lo, hi = site.slices[j], site.slices[j + 1]
                if lora_a.shape[1] != site.in_features or lora_b.shape[0] != hi - lo:
                    raise ValueError(f"layer {site.layer} {proj}: adapter shard {tuple(lora_a.shape)}"
                                     f" / {tuple(lora_b.shape)} does not fit the slot")
                a[j * r:j * r + rank] = lora_a
                b[lo:hi, :rank] = lora_b
        return flat

    def cache(self, adapter_id: int, adapter: Adapter) -> None:
        """Keeps ``adapter`` in the host cache as ``adapter_id``. The control plane keeps the
        cache within ``max_cpu_loras`` (its drops ride on the steps, so reads may land before
        the drops that make room for them): beyond twice that, ValueError."""
        flat = self.pack(adapter)
        with self._lock:
            if adapter_id not in self.host and len(self.host) >= 2 * self.max_cpu_loras:
                raise ValueError(f"the host cache holds {len(self.host)} adapters "
                                 f"(--max-cpu-loras {self.max_cpu_loras}); drop some first")
            self.host[adapter_id] = flat

    def drop(self, adapter_ids, below: int = 0) -> None:
        """Drops ``adapter_ids`` and every id below ``below`` from the host cache."""
        with self._lock:
            for adapter_id in [i for i in self.host if i < below] + list(adapter_ids):
                self.host.pop(adapter_id, None)

    # -- slots --------------------------------------------------------------------------------
    def load(self, slot: int, adapter_id: int) -> None:
        """Copies the cached adapter ``adapter_id`` into ``slot`` (BatchError when either is
        unknown), after every op queued so far on the current stream (see the module doc)."""
        if not 0 <= slot < self.max_loras:
            raise BatchError(f"LoRA slot {slot + 1} out of range (the worker has {self.max_loras})")
        with self._lock:
            flat = self.host.get(adapter_id)
            if flat is not None:
                self.host.move_to_end(adapter_id)
        if flat is None:
            raise BatchError(f"LoRA adapter {adapter_id} is not in the worker's host cache")
        if self.stream is None:
            self.memory[slot].copy_(flat)
        else:
            before = torch.cuda.Event()
            before.record()
            self.stream.wait_event(before)
            with torch.cuda.stream(self.stream):
                self.memory[slot].copy_(flat, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self._pending[slot] = done
        self.held[slot] = adapter_id
        self.num_loads += 1

    def wait_for(self, slots) -> None:
        """The current stream waits (on the device) for the pending loads of ``slots``."""
        if not self._pending:
            return
        for slot in slots:
            event = self._pending.get(slot)
            if event is not None:
                if event.query():
                    del self._pending[slot]
                else:
                    torch.cuda.current_stream().wait_event(event)
