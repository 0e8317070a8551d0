"""How a prepared step's forward pass runs, and what the device needs for it: a full CUDA graph
of the decode forward (``cuda_graphs.DecodeGraphs``: decode-only steps and verifies of decodes
only), the step graphs of prefill and mixed steps (``mixed_graphs.MixedGraphs``, piecewise, or
``full_graphs.FullGraphs``, one whole graph per bucket: ``--cudagraph-mode full``), or eagerly
(no graphs, or a step larger than the largest bucket).

``mode`` picks the path before the step's inputs are uploaded, ``host_arrays`` lists the model
inputs that path reads (the runner adds sampling's and the block copies' arrays and uploads
everything in one copy), and ``logits`` runs it. A step's kind (``step_kind``: decode, mixed,
prefill or verify) and its mode label the data plane's step metrics. The draft model, when
there is one, follows every target forward over the same tokens (``DraftModel.sync``).
"""

from __future__ import annotations

import numpy as np
import torch

from headrace import kernels
from headrace.dataplane.input_batch import PreparedBatch
from headrace.dataplane.lora import batch as lora_batch
from headrace.dataplane.model import AttentionMetadata, CausalLM
from headrace.dataplane.spec_decode import decode_rows
from headrace.kernels.attention_policy import phase_of

KINDS = ("decode", "mixed", "prefill", "verify")
MODES = ("full", "piecewise", "eager")   # how the step's forward ran (``graph`` metric label)


def step_kind(prep: PreparedBatch) -> str:
    """decode (one token per sequence), mixed (decodes and prefill chunks), prefill, or verify
    (speculative drafts checked, with or without prefill chunks beside them)."""
    if prep.num_drafts is not None:
        return "verify"
    return phase_of(prep.decode_only, prep.num_decodes)


class StepForward:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], device: torch.device,
                 max_num_seqs: int, graphs=None, mixed=None, draft=None, attention=None):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.graphs = graphs        # DecodeGraphs or None
        self.mixed = mixed          # MixedGraphs, FullGraphs or None: prefill and mixed steps
        self.draft = draft          # headrace.dataplane.draft_model.DraftModel or None
        self.attention = attention  # headrace.kernels.attention_policy.Policy (None: Triton only)
        self._arange = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self._stepping = None       # the prep ``mode`` sent to the step graphs (``mixed``)
        self.lora = getattr(model, "lora", None)   # headrace.dataplane.lora.batch.LoraBatch (--enable-lora)

    def mode(self, prep: PreparedBatch) -> str:
        """The step's ``graph`` label: full (the decode graphs, or the full step graphs),
        piecewise or eager."""
        n = len(prep.positions)
        self._stepping = None
        if self.graphs is not None and self.graphs.fits(n) and (
                prep.decode_only or decode_rows(prep) is not None):
            return "full"
        if self.mixed is not None and self.mixed.fits(n, len(prep.logits_indices), len(prep.seq_lens)):
            self._stepping = prep
            return self.mixed.label
        return "eager"

    def _step_graphs(self, prep: PreparedBatch, mode: str) -> bool:
        """Whether ``mode`` (``self.mode(prep)``'s) replays the step graphs."""
        return mode != "eager" and self._stepping is prep

    def host_arrays(self, prep: PreparedBatch, mode: str) -> dict[str, np.ndarray]:
        """The model inputs the step's ``mode`` reads, as host arrays."""
        arrays = dict(seq_lens=prep.seq_lens, block_tables=prep.block_tables,
                      last_rows=prep.last_rows, decode_order=prep.decode_order)
        if prep.lora_slots is not None and self.lora is not None:   # tokens of adapters
            prep.lora = lora_batch.plan(prep.lora_slots, self.lora.num_slots, self.lora.max_tokens)
            if prep.lora is not None:
                arrays["lora_meta"] = prep.lora.array
        if self._step_graphs(prep, mode):   # ids, positions, slots, sampled indices: [4, bucket]
            n, m = len(prep.positions), len(prep.logits_indices)
            rows = np.zeros((4, self.mixed.bucket(n)), dtype=np.int64)
            if not prep.decode_only:
                rows[0, :n] = prep.input_ids
            rows[1, :n], rows[2, :n], rows[2, n:] = prep.positions, prep.slot_mapping, -1
            rows[3, :m] = prep.logits_indices
            arrays.update(graph_inputs=rows, last_index=prep.last_index,
                          query_start_loc=prep.query_start_loc, **self.mixed.meta_arrays(prep))
            return arrays
        arrays.update(positions=prep.positions, slot_mapping=prep.slot_mapping)
        if not prep.decode_only:   # a decode reads its token from last_rows and samples every row
            arrays.update(input_ids=prep.input_ids, last_index=prep.last_index,
                          query_start_loc=prep.query_start_loc, logits_indices=prep.logits_indices)
        if mode == "full" and not prep.decode_only:   # a verify replayed as decode rows
            arrays.update(decode_rows(prep))   # per-token lengths and tables
        return arrays

    def logits(self, prep: PreparedBatch, dev: dict[str, torch.Tensor], mode: str,
               last_token: torch.Tensor) -> torch.Tensor | None:
        """Logits of the step's sampling tokens (None when none samples); decodes read their
        input ids from the device's last tokens (``last_token``, by row)."""
        if self.lora is not None:   # which slot each token reads (None: no adapter in the step)
            self.lora.begin(prep.lora, dev.get("lora_meta"))
        if mode == "full" and not self._step_graphs(prep, mode):
            if prep.decode_only:
                input_ids = last_token[dev["last_rows"]]
            else:
                input_ids = self._input_ids(prep, dev, last_token)
            logits = self.graphs.run(input_ids, dev, verify=not prep.decode_only)   # every row samples
            if self.draft is not None:
                self.draft.sync_decode_rows(input_ids, dev)
            return logits
        n = len(prep.positions)
        qsl = dev["query_start_loc"] if "query_start_loc" in dev else self._arange[:n + 1]
        if self._step_graphs(prep, mode):
            mixed = self.mixed   # a full graph's attention is Triton's, inside it: no flash plan
            flash = None if mode == "full" else kernels.flash_attn4.step_plan(
                self.attention, prep, qsl, dev["seq_lens"], dev["block_tables"])
            meta = self._meta(prep, dev, qsl, flash, mixed.slot_mapping[:n])
            logits = mixed.run(dev["graph_inputs"], n, len(prep.logits_indices), meta,
                               dev["last_index"], last_token[dev["last_rows"]],
                               dev.get("graph_meta"))
            if self.draft is not None:
                self.draft.sync(mixed.input_ids[:n], mixed.positions[:n], meta)
            return logits
        flash = kernels.flash_attn4.step_plan(self.attention, prep, qsl, dev["seq_lens"],
                                              dev["block_tables"])
        input_ids = (last_token[dev["last_rows"]] if prep.decode_only
                     else self._input_ids(prep, dev, last_token))
        meta = self._meta(prep, dev, qsl, flash, dev["slot_mapping"])
        hidden = self.model(input_ids, dev["positions"], self.kv_caches, meta)
        if self.draft is not None:   # the draft's KV follows the target's, step by step
            self.draft.sync(input_ids, dev["positions"], meta)
        if len(prep.sample_rows) == 0:
            return None
        if len(prep.logits_indices) != hidden.shape[0]:
            hidden = hidden[dev["logits_indices"]]
        return self.model.logits(hidden)

    @staticmethod
    def _input_ids(prep: PreparedBatch, dev: dict[str, torch.Tensor], last_token: torch.Tensor):
        input_ids = dev["input_ids"]
        if len(prep.last_index):
            input_ids[dev["last_index"]] = last_token[dev["last_rows"]]
        return input_ids

    @staticmethod
    def _meta(prep: PreparedBatch, dev: dict[str, torch.Tensor], qsl: torch.Tensor, flash,
              slot_mapping: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl,
                                 seq_lens=dev["seq_lens"], block_tables=dev["block_tables"],
                                 max_query_len=prep.max_query_len, decode_only=prep.decode_only,
                                 num_decodes=prep.num_decodes, decode_order=dev["decode_order"],
                                 flash=flash)
