"""CUDA graphs of the decode forward pass (and the LM head) for a ladder of batch sizes.

A decode step launches hundreds of small kernels; replaying a captured graph costs about a
microsecond per kernel instead of ten. Each graph reads static input buffers (token ids,
positions, slots, sequence lengths, block tables of the full width), so a step only copies
its inputs in and replays the graph of the smallest captured size that holds its batch;
padded rows write nowhere (slot -1) and attend to one cached position.

A speculative verify whose every sequence samples (no prefill chunk in the step) replays the
same graphs: each verified token is a decode row of its own (``spec_decode.decode_rows``),
with its own context length (its position + 1) and its sequence's block table, so the decode
attention applies the causal mask across the drafts (their K/V are written, layer by layer,
before attention reads them) and the LM head runs over every position. Off CUDA (tests) a
stand-in replays by running the forward pass into the same static buffers.
"""

from __future__ import annotations

import gc
import time

import torch

from headrace.dataplane.lora import graphs as lora_graphs
from headrace.dataplane.model import AttentionMetadata, CausalLM


def batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def capture_graph(run, pool=None, stream: torch.cuda.Stream | None = None,
                  error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """``run()`` captured into a new CUDA graph (in memory pool ``pool``; None: a new one, then
    ``graph.pool()``), on ``stream`` (a side stream, as ``torch.cuda.graph`` captures). Unlike
    ``torch.cuda.graph`` it runs no ``gc.collect()`` and ``empty_cache()`` per capture (vLLM
    skips them too): with a thousand piecewise graphs they would add tens of seconds. It does
    keep the garbage collector off while capturing: a collection then may destroy an earlier
    graph (an older worker's, in a cycle), whose ``cudaGraphExecDestroy`` capture forbids
    ("operation not permitted when stream is capturing"), which invalidates the capture.
    ``error_mode``: CUDA's capture mode (``thread_local`` for a capture while other threads of
    the process keep using the device)."""
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=error_mode)
            try:
                run()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    return graph


class EagerGraph:
    """``torch.cuda.CUDAGraph``'s stand-in off CUDA: ``replay`` runs the forward pass of its
    size over the static buffers into the static output (tests exercise the buffer logic)."""

    def __init__(self, graphs: DecodeGraphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs._forward(self.size)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_batch: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_batch = max_batch
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slot_mapping = torch.full((max_batch,), -1, **i64)
        self.seq_lens = torch.ones(max_batch, **i32)
        self.query_start_loc = torch.arange(max_batch + 1, **i32)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), **i32)
        self.arange = torch.arange(max_batch, **i32)
        self.decode_order = self.arange.clone()   # attention's start order, longest first
        # one logits buffer for every size (each graph writes its rows): a size's logits are
        # read by its step's sampling, which runs before the next step's replay
        self.logits = torch.zeros((max_batch, model.shard.vocab_size),
                                  dtype=model.model.embed_tokens.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}   # with the LoRA kernels
        self.lora = lora_graphs.batch_of(model)   # --enable-lora: its LoraBatch
        self.variants = lora_graphs.variants(self.lora)
        self.outputs: dict[int, torch.Tensor] = {}
        self.sizes = batch_sizes(max_batch)
        self.capture_seconds = 0.0
        self.num_replays = 0          # every replay ...
        self.num_verify_replays = 0   # ... and those of speculative verifies

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size],
                                 query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                                 max_query_len=1, decode_only=True,
                                 decode_order=self.decode_order[:size])
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.logits(hidden, out=self.logits[:size])

    def static_bytes(self) -> int:
        """Device memory of the static buffers (the graphs' pool comes on top)."""
        ts = [self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc,
              self.block_tables, self.arange, self.decode_order, self.logits]
        return sum(t.numel() * t.element_size() for t in ts)

    @torch.inference_mode()
    def capture(self, progress=None, pool=None) -> None:
        """Captures every batch size; ``progress`` (``headrace.dataplane.progress.Progress``) counts
        them; ``pool``: a graph memory pool to capture into (None: a new one, ``self.pool`` after)."""
        start = time.perf_counter()
        if self.device.type != "cuda":
            for active in self.variants:
                for size in self.sizes:
                    self.outputs[size] = self._forward(size)
                    (self.lora_graphs if active else self.graphs)[size] = EagerGraph(self, size)
            return
        stream = torch.cuda.Stream(self.device)
        for active in self.variants:   # with LoRA: a variant with its kernels, one without
            table = self.lora_graphs if active else self.graphs
            for size in reversed(self.sizes):       # largest first: smaller ones reuse its memory
                with lora_graphs.capturing(self.lora, active):
                    self._forward(size)                 # warm-up: compiles kernels, sets up cuBLAS
                    torch.cuda.synchronize(self.device)
                    graph = capture_graph(lambda s=size: self.outputs.__setitem__(s, self._forward(s)),
                                          pool, stream)
                pool = graph.pool() if pool is None else pool
                table[size] = graph
                if progress is not None:
                    progress.update()
        torch.cuda.synchronize(self.device)
        self.pool = pool
        self.capture_seconds = time.perf_counter() - start

    @property
    def num_graphs(self) -> int:
        return len(self.sizes) * len(self.variants)

    def fits(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.max_batch

    def run(self, input_ids: torch.Tensor, dev: dict[str, torch.Tensor], verify: bool = False) -> torch.Tensor:
        """Logits [batch, vocab] of a decode-only step (or a verify's decode rows, ``verify``):
        ``input_ids`` and the uploaded ``dev`` inputs (positions, slot_mapping, seq_lens,
        block_tables, decode_order; one row per token) are device tensors, copied into the
        graph's buffers in stream order (the ids may still be in flight)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(dev["positions"])
        self.slot_mapping[:n].copy_(dev["slot_mapping"])
        self.seq_lens[:n].copy_(dev["seq_lens"])
        tables = dev["block_tables"]
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        self.decode_order[:n].copy_(dev["decode_order"])
        if size > n:   # padded rows: write nowhere, attend to one position of block 0, last
            self.decode_order[n:size].copy_(self.arange[n:size])
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
        (self.lora_graphs if lora_graphs.active(self.lora) else self.graphs)[size].replay()
        self.num_replays += 1
        self.num_verify_replays += int(verify)
        return self.outputs[size][:n]
