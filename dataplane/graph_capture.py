"""Which CUDA graphs a worker captures (``--cudagraph-mode``, ``--enforce-eager``,
``--no-cuda-graphs``, ``--max-cudagraph-capture-size``), the device memory they take and their
capture.

The memory is counted before the KV cache is sized: the graphs' static buffers are allocated
first (``WorkerGraphs`` is built before the KV budget is computed) and their shared memory
pool is reserved at the warm-up's measured activation peak (the largest step's intermediates;
every graph is captured into one pool, largest first, and none holds more than one step's
worth). After the capture the worker logs what the graphs really took (the device's free
memory before and after) beside that estimate, and how long the capture ran.

Modes, as vLLM's ``CUDAGraphMode``: ``full_and_piecewise`` (default): decode-only steps and
verifies of decodes replay a full graph (``cuda_graphs.DecodeGraphs``), prefill and mixed
steps the piecewise graphs (``mixed_graphs.MixedGraphs``); ``full_decode_only``: the decode
graphs only (the behaviour before piecewise graphs); ``piecewise``: every step piecewise (the
decodes' attention launched between pieces too); ``full``: decode-only steps and verifies of
decodes replay the decode graphs, prefill and mixed steps one full graph per bucket
(``full_graphs.FullGraphs``: the unified attention kernel inside); ``none``: every step eagerly.
Whichever graphs serve prefill and mixed steps are the runner's ``mixed``.
"""

from __future__ import annotations

import logging
import time

import torch

from headrace.dataplane.cuda_graphs import DecodeGraphs
from headrace.dataplane.full_graphs import FullGraphs
from headrace.dataplane.kv_cache import GiB
from headrace.dataplane.mixed_graphs import MixedGraphs
from headrace.dataplane.progress import Progress

log = logging.getLogger("headrace.dataplane")

MODES = ("full_and_piecewise", "full_decode_only", "piecewise", "full", "none")
DEFAULT_MAX_CAPTURE_TOKENS = 4096   # above: device-bound steps, where launches cost ~nothing


def resolve_mode(opts) -> str:
    """The effective mode of ``WorkerOptions`` (ValueError naming the flag when it is wrong)."""
    if opts.cudagraph_mode not in MODES:
        raise ValueError(f"--cudagraph-mode {opts.cudagraph_mode!r}: choose from {', '.join(MODES)}")
    if opts.max_cudagraph_capture_size is not None and opts.max_cudagraph_capture_size < 1:
        raise ValueError(f"--max-cudagraph-capture-size {opts.max_cudagraph_capture_size}: "
                         f"must be >= 1 (tokens)")
    return "none" if opts.enforce_eager or not opts.cuda_graphs else opts.cudagraph_mode


def capture_tokens(opts) -> int:
    """The largest step the piecewise or full step graphs cover."""
    cap = opts.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_TOKENS
    return min(opts.max_batched_tokens, cap)


class WorkerGraphs:
    """A worker's decode graphs and step graphs of prefill and mixed steps (``mixed``:
    piecewise or full; either may be None), built with their static buffers before the KV
    cache exists; ``capture`` records them over the cache."""

    def __init__(self, mode: str, model, device: torch.device, max_rows: int,
                 max_blocks_per_seq: int, max_tokens: int):
        self.mode = mode
        self.decode = self.mixed = None
        if mode in ("full_and_piecewise", "full_decode_only", "full"):
            self.decode = DecodeGraphs(model, [], max_rows, max_blocks_per_seq, device)
        logits = self.decode.logits if self.decode else None
        if mode in ("full_and_piecewise", "piecewise"):
            self.mixed = MixedGraphs(model, [], max(max_tokens, 1), max_rows, device, logits=logits)
        elif mode == "full":
            self.mixed = FullGraphs(model, [], max(max_tokens, 1), max_rows, max_rows,
                                    max_blocks_per_seq, device, logits=logits)
        self.device = device
        self.capture_seconds = 0.0
        self.measured_bytes = 0
        self.estimated_bytes = 0

    @property
    def num_graphs(self) -> int:
        return (self.decode.num_graphs if self.decode else 0) + (self.mixed.num_graphs if self.mixed else 0)

    def reserve_bytes(self, activation_bytes: int) -> int:
        """What the graphs will take beyond what is allocated now: their memory pool, at most
        the warm-up's activation peak (their static buffers are allocated already, and
        ``static_bytes`` says how much)."""
        self.estimated_bytes = self.static_bytes() + (activation_bytes if self.num_graphs else 0)
        return activation_bytes if self.num_graphs else 0

    def static_bytes(self) -> int:
        total = self.decode.static_bytes() if self.decode else 0
        if self.mixed is not None:   # its logits are the decode graphs' when both exist
            total += self.mixed.static_bytes() - (
                self.mixed.logits.numel() * self.mixed.logits.element_size() if self.decode else 0)
        return total

    def capture(self, caches: list[torch.Tensor], rank: int = 0) -> None:
        """Captures every graph over the KV cache ``caches``; logs the count, time and memory."""
        if not self.num_graphs:
            return
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        pool = None
        with Progress(f"capturing CUDA graphs ({self.mode})", self.num_graphs, "graphs",
                      rank=rank) as progress:
            if self.decode is not None:
                self.decode.kv_caches = caches
                self.decode.capture(progress)
                pool = self.decode.pool if cuda else None
            if self.mixed is not None:
                self.mixed.kv_caches = caches
                self.mixed.capture(progress, pool)
        if cuda:
            torch.cuda.synchronize(self.device)
            self.measured_bytes = self.static_bytes() + free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - start
        log.info("%s", self.describe())

    def describe(self) -> str:
        parts = []
        if self.decode is not None:
            parts.append(f"{len(self.decode.sizes)} decode sizes up to {self.decode.max_batch}")
            if len(self.decode.variants) > 1:
                parts.append("each graph with and without the LoRA kernels")
        if self.mixed is not None:
            parts.append(f"{len(self.mixed.buckets)} prefill/mixed buckets up to "
                         f"{self.mixed.max_tokens} tokens x {self.mixed.pieces_per_bucket} "
                         f"{'pieces' if self.mixed.label == 'piecewise' else 'full graph'} + "
                         f"{len(self.mixed.row_sizes)} LM-head sizes")
        return (f"CUDA graphs ({self.mode}): {'; '.join(parts)} = {self.num_graphs} graphs, "
                f"captured in {self.capture_seconds:.1f}s; {self.measured_bytes / GiB:.2f} GiB "
                f"({self.estimated_bytes / GiB:.2f} GiB estimated and kept out of the KV cache)")
