"""The draft model of ``--speculative-config '{"method": "draft_model", "model": DIR, ...}'``:
a second, smaller checkpoint sharing the target's tokenizer, held in the same worker with a
KV pool of its own that is indexed by the target's block ids.

Why the same block ids: the control plane owns every block decision (allocation, prefix
hits, copy on write, rollback of rejected positions, preemption). Giving the draft one pool
slot per target slot makes each of those decisions hold for the draft's KV too, with nothing
new on the wire: a block the target computed, the draft computed in the same step.

How its KV stays in step with the target's: every forward the target runs (prefill chunks,
decodes, verifies; eager or a CUDA-graph replay) is followed by the draft's forward over
the same tokens, positions and slots (``sync``), on the same stream. So before a verify the
draft's cache holds every position the target has computed, and ``propose`` only has to run
``k`` greedy decodes from the sequence's last token (written at positions ``p .. p + k - 1``;
the verify's ``sync`` writes ``p .. p + k`` again with the same tokens). K/V written for
rejected drafts sit past the sequence's computed length and are overwritten before anything
reads them, exactly as the target's are.

Greedy drafts are point masses, so ``headrace.dataplane.spec_decode``'s acceptance (accept ``x``
with probability ``p(x)``, else draw from ``p`` without ``x``) keeps the target's distribution
exactly; this is what vLLM's rejection sampler does for drafts without probabilities.

CUDA graphs: with the target's graphs the worker captures the draft's decode for the same
ladder of batch sizes (``capture_graphs``), so its proposals and its syncs of decode steps and
graph-replayed verifies replay graphs too (a small draft's decode is launch-bound); syncs of
steps with prefill chunks run eagerly, like the target's.

Not built: tensor parallelism (the draft would have to run unsharded beside sharded
layers), the host KV tier (its copies move the target's pool only).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from headrace.common.model_source import ModelSourceError, resolve_model

from headrace.dataplane import kv_cache, staging
from headrace.dataplane.config import ModelConfig, load_model_config
from headrace.dataplane.cuda_graphs import DecodeGraphs
from headrace.dataplane.input_batch import InputBatch, longest_first
from headrace.dataplane.loader import load_model
from headrace.dataplane.model import AttentionMetadata, CausalLM


def check_pair(target: ModelConfig, draft: ModelConfig) -> None:
    """ValueError unless ``draft`` can propose for ``target`` (its token ids mean the same)."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"--speculative-config: the draft model's vocabulary ({draft.vocab_size}) "
                         f"is larger than the target's ({target.vocab_size}); they must share a tokenizer")


def check_options(config, target: ModelConfig, world_size: int, kv_offloading_size: float) -> str:
    """The draft's checkpoint directory (a local one, or a Hub id's snapshot, as ``--model``
    resolves); ValueError (one line naming the option) where the worker cannot serve it."""
    if world_size > 1:
        raise ValueError("--speculative-config: method draft_model needs --tensor-parallel-size 1 "
                         "(a draft beside sharded layers is not built)")
    if kv_offloading_size:
        raise ValueError("--speculative-config: method draft_model does not run with "
                         "--kv-offloading-size (the host tier moves only the target's KV)")
    try:
        model_dir = resolve_model(config.model)
    except ModelSourceError as exc:
        raise ValueError(f"--speculative-config: draft model: {exc}") from None
    DraftModel.config_of(model_dir, target)
    return model_dir


class DraftModel:
    def __init__(self, model: CausalLM, device: torch.device):
        self.model, self.device = model, device
        self.kv_caches: list[torch.Tensor] = []   # ``allocate`` makes them
        self.graphs: DecodeGraphs | None = None   # ``capture_graphs`` (CUDA only in serving)
        self.block_size = 0
        self.num_forwards = 0   # draft forward passes run (sync and propose): for tests/bench
        self.max_id: int | None = None   # clamp token ids to this (a smaller vocabulary)

    @classmethod
    def load(cls, model_dir: str, target: ModelConfig, device: torch.device, dtype: torch.dtype,
             max_model_len: int) -> "DraftModel":
        """Loads the weights (before the KV pools are sized from what memory is left)."""
        cfg = cls.config_of(model_dir, target)
        draft = cls(load_model(pathlib.Path(model_dir), cfg, device, dtype, max_model_len), device)
        if cfg.vocab_size < target.vocab_size:   # ids past the draft's table (the target's padding)
            draft.max_id = cfg.vocab_size - 1
        return draft

    @staticmethod
    def config_of(model_dir: str, target: ModelConfig) -> ModelConfig:
        if not pathlib.Path(model_dir).is_dir():
            raise ValueError(f"--speculative-config: draft model directory {model_dir!r} not found")
        cfg = load_model_config(model_dir)
        check_pair(target, cfg)
        return cfg

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return kv_cache.bytes_per_block(self.model.cfg, block_size, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """The draft's KV pool: one slot per slot of the target's (same block ids)."""
        self.block_size = block_size
        self.kv_caches = kv_cache.allocate(self.model.cfg, num_blocks, block_size, kv_dtype, self.device)

    def capture_graphs(self, max_batch: int, max_blocks_per_seq: int, progress=None) -> None:
        """CUDA graphs of the draft's decode for a ladder of batch sizes (the target's ladder:
        its decode steps, verify rows and the proposals all fit): its decodes are launch-bound."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks_per_seq, self.device)
        self.graphs.capture(progress)

    def _decode(self, input_ids: torch.Tensor, rows: dict[str, torch.Tensor], logits: bool = True):
        """A decode row per token (``rows``: positions, slot_mapping, seq_lens, block_tables,
        decode_order): a graph replay where one fits (its logits come free), else eager."""
        n = len(input_ids)
        input_ids = self._ids(input_ids)
        if self.graphs is not None and self.graphs.fits(n):
            return self.graphs.run(input_ids, rows)
        meta = AttentionMetadata(
            slot_mapping=rows["slot_mapping"],
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=rows["seq_lens"], block_tables=rows["block_tables"], max_query_len=1,
            decode_only=True, num_decodes=n, decode_order=rows["decode_order"])
        hidden = self.model(input_ids, rows["positions"], self.kv_caches, meta)
        return self.model.logits(hidden) if logits else None

    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft's forward over the target's step (same tokens, positions, slots): its KV
        then covers what the target's does. Only the KV writes matter; no logits."""
        self.num_forwards += 1
        if meta.decode_only and meta.decode_order is not None:
            self._decode(input_ids, dict(positions=positions, slot_mapping=meta.slot_mapping,
                                         seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                                         decode_order=meta.decode_order), logits=False)
            return
        plain = AttentionMetadata(slot_mapping=meta.slot_mapping, query_start_loc=meta.query_start_loc,
                                  seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                                  max_query_len=meta.max_query_len, decode_only=meta.decode_only,
                                  num_decodes=meta.num_decodes, decode_order=meta.decode_order)
        self.model(self._ids(input_ids), positions, self.kv_caches, plain)

    def _ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's token ids as the draft's embedding can read them: an id past a smaller
        draft vocabulary (padding the target's tokenizer never produces, though sampling may
        pick it) would index out of its table."""
        return input_ids if self.max_id is None else input_ids.clamp_max(self.max_id)

    def sync_decode_rows(self, input_ids: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        """``sync`` for a step the CUDA graphs replayed: one decode row per token (``dev``'s
        per-token lengths and tables, ``spec_decode.decode_rows``)."""
        self.num_forwards += 1
        self._decode(input_ids, dev, logits=False)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: list[int], ks: list[int]) -> list[np.ndarray]:
        """``ks[i]`` greedy drafts for each decode row ``rows[i]`` (its last token is the
        mirror's, at position ``num_tokens - 1``; its block table covers the ``k`` positions
        after it). One batched decode per draft position, over the rows still drafting."""
        dev, bs = self.device, self.block_size
        rows_np = np.asarray(rows, np.int64)
        ks_np = np.asarray(ks, np.int64)
        start = batch.num_tokens[rows_np] - 1                      # position of the last token
        tokens = torch.as_tensor(batch.tokens[rows_np, start].astype(np.int64), device=dev)
        out = torch.zeros((len(rows), int(ks_np.max())), dtype=torch.int64, device=dev)
        for j in range(int(ks_np.max())):
            live = np.flatnonzero(ks_np > j)
            pos = start[live] + j
            table = batch.block_table[rows_np[live]]
            slots = table[np.arange(len(live)), pos // bs].astype(np.int64) * bs + pos % bs
            seq_lens = (pos + 1).astype(np.int32)
            decode = staging.upload(dict(
                positions=pos, slot_mapping=slots, seq_lens=seq_lens,
                block_tables=table[:, :int(pos.max()) // bs + 1], decode_order=longest_first(seq_lens),
                live=live), dev)
            live_t = decode.pop("live")
            inputs = tokens[live_t] if j == 0 else out[live_t, j - 1]
            out[live_t, j] = self._decode(inputs, decode).argmax(dim=-1)
            self.num_forwards += 1
        host = out.cpu().numpy()
        return [host[i, :k] for i, k in enumerate(ks)]
