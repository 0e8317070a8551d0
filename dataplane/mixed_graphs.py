"""Piecewise CUDA graphs of prefill and mixed (prefill + decode) steps, one set per token-count
bucket; the attention runs eagerly between the pieces (vLLM V1's piecewise mode).

Why: an eager step of Qwen3-0.6B launches ~600 kernels from Python (~10 µs of host time each
on the H200, REFERENCE §1), so under continuous arrivals, where nearly every step carries a
prefill chunk, a step took ~17 ms of which 8.4 ms on the device. Everything of a layer but
its attention is the same kernels at every step of a given token count, so it is captured:
piece 0 is the embedding and layer 0 up to its attention (input norm, q/k/v projection, the
norm/rotary/KV-write prologue); piece k is layer k-1's o_proj, post-attention norm and MLP
plus layer k's pre-attention part; the last piece ends the last layer, applies the final
norm and gathers the rows that sample (``rows[3]``: their token indices) into a static
buffer. The LM head then runs over those rows only, replayed from a graph of its own for a
ladder of row counts (``batch_sizes``), into one static logits buffer. A step of n tokens
replays the smallest bucket T >= n; the T - n padded tokens have slot -1 (the prologue
writes no KV for them), attention runs over the n real tokens only, and their rows are
independent of the real ones in every captured kernel (row-wise norms, GEMMs), so they
change nothing; the sampler reads the real rows' logits only.

The choice between the two designs (REFERENCE §8), and what to expect: piecewise reuses our
attention kernels (Triton decode + prefill, or flash-attn-4 for long prefills) unchanged and
exactly; per layer it costs one graph launch (~2-5 µs of host) and one to three attention
launches (~10-20 µs each for Triton's launcher), so a 28-layer mixed step costs ~1-1.5 ms of
host time, which overlaps the device's ~4-9 ms instead of adding ~6 ms to it; the captured
kernels replay at ~1.2 µs each instead of ~10 µs. A full graph (one graph per bucket,
attention inside) would save the remaining ~56-84 attention launches (~0.5-1 ms), but needs
one attention kernel whose grid is fixed by the bucket and whose metadata (query offsets,
lengths, tables, the decode split) live in static buffers, e.g. a unified kernel mapping
programs to sequences by a search over the query offsets; that kernel does not exist here
yet. The pieces' boundaries are the only contract with the runner (``run`` takes the step's
inputs and attention metadata and returns logits), so a full-graph class can replace this
one behind the same call; ``bench/step_host.py`` measures eager and piecewise steps on the
GPU (``bench/mixed_gpu_check.sh``), and the numbers decide the next step.

Buckets: the decode ladder up to 256 tokens (1, 2, 4, 8, then steps of 16), then eight
sizes per doubling (256, 288, ..., 512, 576, ...: at most 12.5% padding) up to the largest
step the scheduler emits (``--max-batched-tokens``), capped by ``--max-cudagraph-capture-size``
(larger steps are device-bound: they run eagerly). All pieces of all buckets share one
memory pool (largest first; smaller ones reuse its intermediates); the inputs, the carried
residual, q, the attention output, the sampled rows and the logits are static buffers of the
largest size. Off CUDA (tests) ``EagerPiece`` stands in for each graph: its replay runs the
piece over the same static buffers, so the buffer logic is what the CPU tests exercise.
"""

from __future__ import annotations

import time

import torch

from headrace.dataplane.cuda_graphs import batch_sizes, capture_graph
from headrace.dataplane.lora import graphs as lora_graphs
from headrace.dataplane.model import AttentionMetadata, CausalLM

STEPS_PER_DOUBLING = 8   # buckets between 256 and 512 tokens, 512 and 1024, ...


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: the decode ladder up to 256, then STEPS_PER_DOUBLING sizes per
    doubling, ending with ``max_tokens`` itself."""
    sizes = batch_sizes(min(max_tokens, 256))
    base = 256
    while sizes[-1] < max_tokens:
        sizes += [s for s in (base + base * i // STEPS_PER_DOUBLING
                              for i in range(1, STEPS_PER_DOUBLING + 1)) if s < max_tokens]
        base *= 2
        if base >= max_tokens:
            sizes.append(max_tokens)
    return sizes


class EagerPiece:
    """``torch.cuda.CUDAGraph``'s stand-in off CUDA: ``replay`` runs the piece."""

    def __init__(self, run):
        self.replay = run


class MixedGraphs:
    """The pieces of every bucket and the LM-head graphs. ``max_rows``: the most rows one step
    samples (the decode graphs' ladder size); ``logits``: a [max_rows, vocab] buffer to share
    (the decode graphs'), or None to allocate one; ``lm_head``: False for a draft model, whose
    syncs write KV only."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_tokens: int,
                 max_rows: int, device: torch.device, logits: torch.Tensor | None = None,
                 lm_head: bool = True):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        cfg, self.max_tokens = model.cfg, max_tokens
        self.max_rows = min(max_rows, max_tokens)
        self.num_layers = cfg.num_layers
        dtype = model.model.embed_tokens.weight.dtype
        act = dict(dtype=dtype, device=device)
        # rows: input ids, positions, slots (-1: write nowhere), sampled token indices
        self.rows = torch.zeros((4, max_tokens), dtype=torch.int64, device=device)
        self.rows[2].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping, self.sample_index = self.rows
        self.buffers = self._buffers(max_tokens, act)   # what the pieces carry between them
        self.sampled = torch.zeros((self.max_rows, cfg.hidden_size), **act)
        self.lm_head = lm_head
        if lm_head and logits is None:
            logits = torch.zeros((self.max_rows, model.shard.vocab_size), **act)
        self.logits = logits
        self.buckets = token_buckets(max_tokens)
        self.row_sizes = batch_sizes(self.max_rows) if lm_head else []
        self.pieces: dict[int, list] = {}
        self.lora_pieces: dict[int, list] = {}   # with the LoRA kernels (``headrace.dataplane.lora.graphs``)
        self.lora = lora_graphs.batch_of(model)   # --enable-lora: its LoraBatch
        self.variants = lora_graphs.variants(self.lora)
        self.heads: dict[int, object] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0

    label = "piecewise"   # the ``graph`` label of the steps it runs (``forward.MODES``)

    def _buffers(self, max_tokens: int, act: dict) -> list[torch.Tensor]:
        cfg = self.model.cfg
        self.q = torch.zeros((max_tokens, cfg.num_heads, cfg.head_dim), **act)
        self.attn = torch.zeros((max_tokens, cfg.num_heads, cfg.head_dim), **act)
        self.residual = torch.zeros((max_tokens, cfg.hidden_size), **act)
        return [self.q, self.attn, self.residual]

    @property
    def pieces_per_bucket(self) -> int:
        return self.num_layers + 1

    @property
    def num_graphs(self) -> int:
        return len(self.buckets) * self.pieces_per_bucket * len(self.variants) + len(self.row_sizes)

    def static_bytes(self) -> int:
        """Device memory of the static buffers (the graphs' pool comes on top)."""
        ts = [self.rows, self.sampled, *self.buffers]
        return sum(t.numel() * t.element_size() for t in ts) + (
            self.logits.numel() * self.logits.element_size() if self.lm_head else 0)

    def _piece(self, size: int, k: int) -> None:
        """Piece k of bucket ``size`` over the static buffers (see the module docstring)."""
        layers, decoder = self.model.model.layers, self.model.model
        positions, slots = self.positions[:size], self.slot_mapping[:size]
        if k == 0:
            h, residual = decoder.embed_tokens(self.input_ids[:size]), None
        else:
            h, residual = layers[k - 1].post_attention(self.attn[:size], self.residual[:size])
        if k < self.num_layers:
            q, residual = layers[k].pre_attention(positions, h, residual, self.kv_caches[k], slots)
            self.q[:size].copy_(q)
            self.residual[:size].copy_(residual)
            return
        rows = min(size, self.max_rows)
        h = decoder.final_norm(h, residual)
        torch.index_select(h, 0, self.sample_index[:rows], out=self.sampled[:rows])

    def _head(self, rows: int) -> None:
        self.model.logits(self.sampled[:rows], out=self.logits[:rows])

    @torch.inference_mode()
    def capture(self, progress=None, pool=None) -> None:
        """Captures every bucket's pieces, largest first, and the LM-head ladder; ``pool``: a
        graph memory pool to share (the decode graphs'); ``progress`` counts graphs."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        jobs = [(active, size, k) for active in self.variants for size in reversed(self.buckets)
                for k in range(self.pieces_per_bucket)]
        jobs += [(False, rows, None) for rows in reversed(self.row_sizes)]
        stream = torch.cuda.Stream(self.device) if cuda else None
        for active, size, k in jobs:
            run = (lambda s=size: self._head(s)) if k is None else (lambda s=size, k=k: self._piece(s, k))
            if not cuda:
                graph = EagerPiece(run)
            else:
                with lora_graphs.capturing(self.lora, active):
                    run()   # warm-up: compiles kernels, sets up cuBLAS
                    torch.cuda.synchronize(self.device)
                    graph = capture_graph(run, pool, stream)
                pool = graph.pool() if pool is None else pool
            if k is None:
                self.heads[size] = graph
            else:
                (self.lora_pieces if active else self.pieces).setdefault(size, []).append(graph)
            if progress is not None:
                progress.update()
        if cuda:
            torch.cuda.synchronize(self.device)
        self.pool = pool
        self.capture_seconds = time.perf_counter() - start

    def fits(self, num_tokens: int, num_rows: int, num_seqs: int = 0) -> bool:
        """Whether a step of ``num_tokens`` tokens sampling ``num_rows`` rows can replay."""
        return bool(self.pieces) and num_tokens <= self.max_tokens and num_rows <= self.max_rows

    def pieces_of(self, size: int) -> list:
        """The bucket's pieces in the step's variant (with the LoRA kernels or without)."""
        return (self.lora_pieces if lora_graphs.active(self.lora) else self.pieces)[size]

    def bucket(self, num_tokens: int) -> int:
        return next(s for s in self.buckets if s >= num_tokens)

    def meta_arrays(self, prep) -> dict:
        """Host arrays of a step's metadata its graphs read (the pieces: none, the attention
        between them reads the step's own)."""
        return {}

    def _replay_head(self, num_rows: int) -> torch.Tensor | None:
        if num_rows == 0 or not self.lm_head:
            return None
        head_rows = next(s for s in self.row_sizes if s >= num_rows)
        self.heads[head_rows].replay()
        return self.logits[:num_rows]

    def run(self, rows: torch.Tensor, num_tokens: int, num_rows: int, meta: AttentionMetadata,
            last_index: torch.Tensor | None = None, last_tokens: torch.Tensor | None = None,
            graph_meta: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [num_rows, vocab] of the step (None when it samples nothing). ``rows``: the
        step's [4, bucket] int64 inputs on the device (``graph_inputs``: ids, positions, slots
        padded with -1, sampled token indices), copied into the static buffers in stream
        order; ``last_index``/``last_tokens``: the decodes' input ids, which live on the device
        (the tokens just sampled), scattered into the ids after the copy; ``meta``: the real
        tokens' attention metadata (its slot_mapping is not read); ``graph_meta``: the
        uploaded ``meta_arrays`` (full graphs)."""
        size = rows.shape[1]
        self.rows[:, :size].copy_(rows)
        if last_index is not None and len(last_index):
            self.input_ids[last_index] = last_tokens
        pieces, layers = self.pieces_of(size), self.model.model.layers
        n = num_tokens
        for k, piece in enumerate(pieces):
            piece.replay()
            if k < self.num_layers:
                layers[k].self_attn.attend(self.q[:n], self.kv_caches[k], meta, out=self.attn[:n])
        self.num_replays += 1
        return self._replay_head(num_rows)
