"""Executes steps: applies the control plane's step delta to the persistent ``InputBatch``,
runs the model over the paged KV cache (replaying a CUDA graph for decode-only steps on a
GPU) and samples.

The mirror is updated only from StepRequests (the control plane decides everything); the
runner appends the tokens it samples itself, so a running sequence's step delta is just
its id, token count and new blocks.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import kernels
from dataplane.input_batch import BatchError, InputBatch, PreparedBatch
from dataplane.model import AttentionMetadata, CausalLM
from dataplane.sampler import SamplingRow, sample
from headrace.dataplane.v1 import worker_pb2 as pb

StepError = BatchError


def _row(seq: pb.NewSequence) -> SamplingRow:
    s = seq.sampling
    return SamplingRow(
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty or 1.0, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed if s.has_seed else None,
        logprobs=s.logprobs, min_tokens=s.min_tokens,
        suppress_token_ids=list(s.suppress_token_ids),
        prompt_token_ids=list(seq.prompt_token_ids), output_token_ids=list(seq.output_token_ids))


def to_device(prep: PreparedBatch, device: torch.device):
    """(input_ids, positions, metadata) tensors of a prepared batch on ``device``."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)  # noqa: E731
    meta = AttentionMetadata(slot_mapping=t(prep.slot_mapping), query_start_loc=t(prep.query_start_loc),
                             seq_lens=t(prep.seq_lens), block_tables=t(prep.block_tables),
                             max_query_len=prep.max_query_len, decode_only=prep.decode_only)
    return t(prep.input_ids), t(prep.positions), meta


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, max_model_len: int, max_num_seqs: int = 256,
                 graphs=None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[1]
        self.device = device
        self.max_model_len = max_model_len
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.num_blocks)
        self.seq_of_row = np.zeros(max_num_seqs, dtype=np.int64)
        self.graphs = graphs   # dataplane.cuda_graphs.DecodeGraphs or None

    def reset(self) -> None:
        """Forgets every sequence (a new control plane stream starts from nothing)."""
        self.batch.clear()

    def _apply_diff(self, step: pb.StepRequest) -> tuple[np.ndarray, np.ndarray]:
        batch = self.batch
        for sid in step.finished_seq_ids:
            batch.remove(sid)
        rows, counts = [], []
        for new in step.new_seqs:
            row = batch.add(new.seq_id, _row(new), new.block_ids, new.num_computed_tokens)
            self.seq_of_row[row] = new.seq_id
            rows.append(row)
            counts.append(new.num_scheduled_tokens)
        n_blocks, block_ids, pos = step.running_new_block_counts, step.running_new_block_ids, 0
        for i, sid in enumerate(step.running_seq_ids):
            row = batch.row_of(sid)
            k = n_blocks[i] if i < len(n_blocks) else 0
            if k:
                batch.append_blocks(row, block_ids[pos:pos + k])
                pos += k
            rows.append(row)
        counts.extend(step.running_num_scheduled)
        if len(counts) != len(rows) or len(set(rows)) != len(rows):
            raise StepError("running_num_scheduled does not match running_seq_ids, or a sequence repeats")
        if step.copy_src_blocks or step.copy_dst_blocks:
            self._copy_blocks(step.copy_src_blocks, step.copy_dst_blocks)
        return np.asarray(rows, dtype=np.int64), np.asarray(counts, dtype=np.int64)

    def _copy_blocks(self, src, dst) -> None:
        if len(src) != len(dst) or any(b >= self.num_blocks for b in list(src) + list(dst)):
            raise StepError("copy_src_blocks/copy_dst_blocks: mismatched or out of range")
        kernels.copy_blocks(self.kv_caches, torch.tensor(src, device=self.device),
                            torch.tensor(dst, device=self.device))

    def forward_logits(self, prep: PreparedBatch) -> torch.Tensor:
        """Logits [sampling rows, vocab] float32 of a prepared batch."""
        if self.graphs is not None and prep.decode_only and self.graphs.fits(len(prep.input_ids)):
            hidden = self.graphs.run(prep)
        else:
            input_ids, positions, meta = to_device(prep, self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if len(prep.logits_indices) != hidden.shape[0]:
            hidden = hidden[torch.from_numpy(prep.logits_indices).to(self.device)]
        return self.model.logits(hidden)

    @torch.inference_mode()
    def execute(self, step: pb.StepRequest) -> pb.StepResult:
        t0 = time.perf_counter()
        rows, counts = self._apply_diff(step)
        result = pb.StepResult(step_id=step.step_id)
        if len(rows) == 0:
            return result
        prep = self.batch.prepare(rows, counts)
        if len(prep.sample_rows):
            logits = self.forward_logits(prep)
            out = sample(logits, self.batch.sampling_batch(prep.sample_rows))
            self.batch.append_tokens(prep.sample_rows, out.token_ids)
            result.seq_ids.extend(self.seq_of_row[prep.sample_rows].tolist())
            result.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                result.logprobs.extend(out.logprobs)
                for ids, vals in zip(out.top_token_ids, out.top_logprobs):
                    result.top_token_ids.extend(ids)
                    result.top_logprobs.extend(vals)
        else:   # a step of prefill chunks only: compute KV, sample nothing
            input_ids, positions, meta = to_device(prep, self.device)
            self.model(input_ids, positions, self.kv_caches, meta)
        result.execute_ms = (time.perf_counter() - t0) * 1e3
        return result
