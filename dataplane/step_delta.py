"""Applies a StepRequest's delta to the worker's mirror (``InputBatch``): sequences to forget,
block tables cut back, new sequences in full, running ones' new blocks; returns the rows the
step computes and how many tokens each.

The running sequences travel as parallel arrays (worker.proto), so their part is array work:
ids to rows by one C-level lookup (``operator.itemgetter``), the protobuf arrays read into
numpy once, new blocks appended in one vectorised call. Only new sequences (their prompts
and sampling parameters) are handled one by one.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from dataplane.input_batch import BatchError, InputBatch
from dataplane.launched import sampling_row
from headrace.dataplane.v1 import worker_pb2 as pb


@dataclasses.dataclass
class StepRows:
    rows: np.ndarray       # [seqs] int64: the rows the step computes (new ones first)
    counts: np.ndarray     # [seqs] int64: tokens scheduled per row
    new_rows: list[int]    # rows of the sequences new to the worker ...
    new_last: list[int]    # ... and their last known token (the device's last-token table)
    spec: np.ndarray       # [seqs] int64: speculative positions per row (zeros: none)


def _ints(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def rows_of(batch: InputBatch, seq_ids) -> np.ndarray:
    """The rows of ``seq_ids`` (BatchError naming an unknown one)."""
    if len(seq_ids) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        found = operator.itemgetter(*seq_ids)(batch.rows)
    except KeyError as exc:
        raise BatchError(f"unknown sequence {exc.args[0]}") from None
    return _ints(found) if len(seq_ids) > 1 else np.array([found], dtype=np.int64)


def apply(batch: InputBatch, step: pb.StepRequest, seq_of_row: np.ndarray, num_blocks: int,
          speculating: bool) -> StepRows:
    """Updates the mirror from ``step``; ``seq_of_row`` (row -> seq id) learns the new rows;
    ``speculating``: whether the worker speculates (else running_num_spec is ignored)."""
    for sid in step.finished_seq_ids:
        batch.remove(sid)
    if step.truncate_seq_ids:
        batch.truncate(step.truncate_seq_ids, step.truncate_num_blocks)
    new_rows, new_counts, last = [], [], []
    for new in step.new_seqs:
        row_state = sampling_row(new)
        row = batch.add(new.seq_id, row_state, new.block_ids, new.num_computed_tokens)
        seq_of_row[row] = new.seq_id
        new_rows.append(row)
        new_counts.append(new.num_scheduled_tokens)
        last.append((row_state.output_token_ids or row_state.prompt_token_ids)[-1])
    running_ids = step.running_seq_ids
    running = rows_of(batch, running_ids)
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
        keep = np.fromiter((s not in batch.stopped for s in running_ids), dtype=bool,
                           count=len(running_ids))
        running, scheduled, spec = running[keep], scheduled[keep], spec[keep]
        rows = np.concatenate((rows[:len(new_rows)], running))
    src, dst = step.copy_src_blocks, step.copy_dst_blocks
    if len(src) != len(dst) or (len(src) and max(max(src), max(dst)) >= num_blocks):
        raise BatchError("copy_src_blocks/copy_dst_blocks: mismatched or out of range")
    counts = np.concatenate((np.asarray(new_counts, dtype=np.int64), scheduled))
    spec = np.concatenate((np.zeros(len(new_rows), dtype=np.int64), spec))
    return StepRows(rows, counts, new_rows, last, spec)
