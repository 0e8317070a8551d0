"""Applies a StepRequest's delta to the worker's mirror (``InputBatch``): sequences to forget,
block tables cut back, new sequences in full, running ones' new blocks; returns the rows the
step computes and how many tokens each.

The running sequences travel as parallel arrays (worker.proto), so their part is array work:
ids to rows by a search in the sorted held ids (``RowIndex``), the protobuf arrays read into
numpy once, new blocks appended in one vectorised call. Only new sequences (their prompts
and sampling parameters) are handled one by one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from headrace.dataplane.input_batch import BatchError, InputBatch
from headrace.dataplane.launched import sampling_row
from headrace.worker.v1 import worker_pb2 as pb


@dataclasses.dataclass
class StepRows:
    rows: np.ndarray       # [seqs] int64: the rows the step computes (new ones first)
    counts: np.ndarray     # [seqs] int64: tokens scheduled per row
    new_rows: list[int]    # rows of the sequences new to the worker ...
    new_last: list[int]    # ... and their last known token (the device's last-token table)
    spec: np.ndarray       # [seqs] int64: speculative positions per row (zeros: none)


def _ints(values) -> np.ndarray:
    """A protobuf repeated field as an int64 array (np.array reads it ~5x faster than
    iterating it)."""
    return np.array(values, dtype=np.int64)


class RowIndex:
    """Seq id -> row for arrays of ids: the held ids sorted (rebuilt when the mirror's set of
    sequences changed, ``InputBatch.version``) and searched."""

    def __init__(self, batch: InputBatch):
        self.batch, self._version = batch, -1
        self._ids = np.zeros(0, dtype=np.uint64)
        self._rows = np.zeros(0, dtype=np.int64)

    def lookup(self, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found): each id's row (0 where it is not held) and whether it is held."""
        if self._version != self.batch.version:
            held = self.batch.rows
            ids = np.array(list(held), dtype=np.uint64)
            order = np.argsort(ids)
            self._ids = ids[order]
            self._rows = np.array(list(held.values()), dtype=np.int64)[order]
            self._version = self.batch.version
        if len(self._ids) == 0:
            return np.zeros(len(seq_ids), dtype=np.int64), np.zeros(len(seq_ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self._ids, seq_ids), len(self._ids) - 1)
        found = self._ids[pos] == seq_ids
        return np.where(found, self._rows[pos], 0), found

    def rows_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """The rows of ``seq_ids`` (BatchError naming an unknown one)."""
        rows, found = self.lookup(seq_ids)
        if not found.all():
            raise BatchError(f"unknown sequence {seq_ids[~found][0]}")
        return rows


def apply(batch: InputBatch, index: RowIndex, step: pb.StepRequest, seq_of_row: np.ndarray,
          num_blocks: int, speculating: bool) -> StepRows:
    """Updates the mirror from ``step``; ``index``: the batch's RowIndex; ``seq_of_row`` (row ->
    seq id) learns the new rows; ``speculating``: whether the worker speculates (else
    running_num_spec is ignored)."""
    for sid in step.finished_seq_ids:
        batch.remove(sid)
    if step.truncate_seq_ids:
        batch.truncate(step.truncate_seq_ids, step.truncate_num_blocks)
    new_rows, new_counts, last = [], [], []
    for new in step.new_seqs:
        row_state = sampling_row(new)
        row = batch.add(new.seq_id, row_state, new.block_ids, new.num_computed_tokens,
                        new.lora_slot - 1)
        seq_of_row[row] = new.seq_id
        new_rows.append(row)
        new_counts.append(new.num_scheduled_tokens)
        last.append((row_state.output_token_ids or row_state.prompt_token_ids)[-1])
    running_ids = np.array(step.running_seq_ids, dtype=np.uint64)
    running = index.rows_of(running_ids)
    n_blocks = _ints(step.running_new_block_counts)
    if len(n_blocks) and n_blocks.any():
        if len(n_blocks) > len(running) or n_blocks.sum() != len(step.running_new_block_ids):
            raise BatchError("running_new_block_counts does not match running_new_block_ids")
        nz = np.flatnonzero(n_blocks)
        batch.append_blocks(running[nz], n_blocks[nz], _ints(step.running_new_block_ids))
    scheduled = _ints(step.running_num_scheduled)
    if len(scheduled) != len(running):
        raise BatchError("running_num_scheduled does not match running_seq_ids, or a sequence repeats")
    rows = np.concatenate((np.asarray(new_rows, dtype=np.int64), running))
    if len(np.unique(rows)) != len(rows):
        raise BatchError("running_num_scheduled does not match running_seq_ids, or a sequence repeats")
    spec = step.running_num_spec
    if len(spec) not in (0, len(running)):
        raise BatchError("running_num_spec does not match running_seq_ids")
    spec = _ints(spec) if len(spec) and speculating else np.zeros(len(running), dtype=np.int64)
    if batch.stopped:   # sent before the control plane saw their stop token: not run
        keep = ~np.isin(running_ids, np.array(list(batch.stopped), dtype=np.uint64))
        running, scheduled, spec = running[keep], scheduled[keep], spec[keep]
        rows = np.concatenate((rows[:len(new_rows)], running))
    src, dst = step.copy_src_blocks, step.copy_dst_blocks
    if len(src) != len(dst) or (len(src) and max(max(src), max(dst)) >= num_blocks):
        raise BatchError("copy_src_blocks/copy_dst_blocks: mismatched or out of range")
    counts = np.concatenate((np.asarray(new_counts, dtype=np.int64), scheduled))
    spec = np.concatenate((np.zeros(len(new_rows), dtype=np.int64), spec))
    return StepRows(rows, counts, new_rows, last, spec)
