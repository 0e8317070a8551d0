"""Executes steps: mirrors the control plane's sequences and block tables, builds the flattened
batch, runs the model over the paged KV cache and samples.

The mirror is updated only from StepRequests (the control plane decides everything); the
runner appends the tokens it samples itself, so a running sequence's step delta is just
its id, token count and new blocks.
"""

from __future__ import annotations

import dataclasses
import time

import torch

import kernels
from dataplane.model import AttentionMetadata, CausalLM
from dataplane.sampler import SamplingRow, sample
from headrace.dataplane.v1 import worker_pb2 as pb


class StepError(ValueError):
    """A StepRequest that contradicts the worker's mirror (a control-plane bug or a stale stream)."""


@dataclasses.dataclass
class Sequence:
    seq_id: int
    row: SamplingRow          # parameters plus prompt/output history
    block_table: list[int]
    num_computed: int

    @property
    def num_tokens(self) -> int:
        return len(self.row.prompt_token_ids) + len(self.row.output_token_ids)

    def token(self, i: int) -> int:
        n = len(self.row.prompt_token_ids)
        return self.row.prompt_token_ids[i] if i < n else self.row.output_token_ids[i - n]


def _row(seq: pb.NewSequence) -> SamplingRow:
    s = seq.sampling
    return SamplingRow(
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty or 1.0, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed if s.has_seed else None,
        logprobs=s.logprobs, min_tokens=s.min_tokens,
        suppress_token_ids=list(s.suppress_token_ids),
        prompt_token_ids=list(seq.prompt_token_ids), output_token_ids=list(seq.output_token_ids))


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, max_model_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[1]
        self.device = device
        self.max_model_len = max_model_len
        self.seqs: dict[int, Sequence] = {}

    def reset(self) -> None:
        """Forgets every sequence (a new control plane stream starts from nothing)."""
        self.seqs.clear()

    def _apply_diff(self, step: pb.StepRequest) -> list[tuple[Sequence, int]]:
        for sid in step.finished_seq_ids:
            self.seqs.pop(sid, None)
        scheduled: list[tuple[Sequence, int]] = []
        for new in step.new_seqs:
            if new.seq_id in self.seqs:
                raise StepError(f"sequence {new.seq_id} is already running")
            seq = Sequence(new.seq_id, _row(new), list(new.block_ids), new.num_computed_tokens)
            self.seqs[new.seq_id] = seq
            scheduled.append((seq, new.num_scheduled_tokens))
        counts, ids, pos = step.running_new_block_counts, step.running_new_block_ids, 0
        for i, sid in enumerate(step.running_seq_ids):
            seq = self.seqs.get(sid)
            if seq is None:
                raise StepError(f"unknown sequence {sid}")
            n_new = counts[i] if i < len(counts) else 0
            seq.block_table.extend(ids[pos:pos + n_new])
            pos += n_new
            scheduled.append((seq, step.running_num_scheduled[i]))
        for seq, n in scheduled:
            end = seq.num_computed + n
            if n < 1 or end > seq.num_tokens:
                raise StepError(f"sequence {seq.seq_id}: {n} tokens scheduled at {seq.num_computed}"
                                f" of {seq.num_tokens}")
            if end > len(seq.block_table) * self.block_size:
                raise StepError(f"sequence {seq.seq_id}: block table too short for {end} tokens")
            if any(b >= self.num_blocks for b in seq.block_table):
                raise StepError(f"sequence {seq.seq_id}: block id out of range")
        return scheduled

    def _copy_blocks(self, src, dst) -> None:
        if len(src) != len(dst) or any(b >= self.num_blocks for b in list(src) + list(dst)):
            raise StepError("copy_src_blocks/copy_dst_blocks: mismatched or out of range")
        kernels.copy_blocks(self.kv_caches, torch.tensor(src, device=self.device),
                            torch.tensor(dst, device=self.device))

    def _prepare(self, scheduled: list[tuple[Sequence, int]]):
        tokens, positions, slots, starts, seq_lens, sample_idx = [], [], [], [0], [], []
        bs = self.block_size
        for seq, n in scheduled:
            begin, end = seq.num_computed, seq.num_computed + n
            for p in range(begin, end):
                tokens.append(seq.token(p))
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            positions.extend(range(begin, end))
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_idx.append(len(tokens) - 1)
        width = max(len(s.block_table) for s, _ in scheduled)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s, _ in scheduled]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev))
        return (torch.tensor(tokens, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta, sample_idx)

    @torch.inference_mode()
    def execute(self, step: pb.StepRequest) -> pb.StepResult:
        t0 = time.perf_counter()
        scheduled = self._apply_diff(step)
        if step.copy_src_blocks:
            self._copy_blocks(step.copy_src_blocks, step.copy_dst_blocks)
        result = pb.StepResult(step_id=step.step_id)
        if not scheduled:
            return result
        input_ids, positions, meta, sample_idx = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling = [seq for seq, n in scheduled if seq.num_computed + n == seq.num_tokens]
        for seq, n in scheduled:
            seq.num_computed += n
        if sampling:
            logits = self.model.logits(hidden[torch.tensor(sample_idx, device=self.device)])
            out = sample(logits, [s.row for s in sampling])
            for seq, tok in zip(sampling, out.token_ids):
                seq.row.output_token_ids.append(tok)
            result.seq_ids.extend(s.seq_id for s in sampling)
            result.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                result.logprobs.extend(out.logprobs)
                for ids, vals in zip(out.top_token_ids, out.top_logprobs):
                    result.top_token_ids.extend(ids)
                    result.top_logprobs.extend(vals)
        result.execute_ms = (time.perf_counter() - t0) * 1e3
        return result
