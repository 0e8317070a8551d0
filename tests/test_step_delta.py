"""headrace.dataplane.step_delta: a StepRequest's delta applied to the mirror with array work; seq
ids found by a search over the sorted held ids, which agrees with the mirror's dict whatever the
order of adds and removes; bad deltas are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from headrace.dataplane.input_batch import BatchError, InputBatch
from headrace.dataplane.step_delta import RowIndex, apply
from headrace.worker.v1 import worker_pb2 as wpb
from tests.test_input_batch import srow


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2**64 - 1)), max_size=40),
       st.lists(st.integers(0, 2**64 - 1), max_size=10))
def test_the_row_index_agrees_with_the_mirror(ops, probes):
    batch = InputBatch(max_seqs=64, max_model_len=16, block_size=4, num_blocks=8)
    index = RowIndex(batch)
    for add, seq_id in ops:
        if add and seq_id not in batch.rows and len(batch.rows) < 64:
            batch.add(seq_id, srow([1]), [0], num_computed=0)
        elif not add:
            batch.remove(seq_id)
        ids = np.array(list(batch.rows) + probes, dtype=np.uint64)
        rows, found = index.lookup(ids)
        assert found.tolist() == [int(s) in batch.rows for s in ids]
        assert rows[found].tolist() == [batch.rows[int(s)] for s in ids[found]]


def _mirror():
    batch = InputBatch(max_seqs=4, max_model_len=64, block_size=4, num_blocks=16)
    for sid in (7, 2**63 + 5):
        batch.add(sid, srow([1, 2, 3]), [sid % 16], num_computed=3)
    return batch, RowIndex(batch), np.zeros(4, dtype=np.int64)


def test_a_delta_gives_the_rows_counts_and_new_blocks():
    batch, index, seq_of_row = _mirror()
    step = wpb.StepRequest(running_seq_ids=[2**63 + 5, 7], running_num_scheduled=[1, 1],
                           running_new_block_counts=[0, 2], running_new_block_ids=[9, 10],
                           finished_seq_ids=[99])
    new = step.new_seqs.add(seq_id=11, prompt_token_ids=[4, 5], block_ids=[12],
                            num_scheduled_tokens=2, sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    out = apply(batch, index, step, seq_of_row, 16, speculating=False)
    assert out.rows.tolist() == [batch.rows[11], batch.rows[2**63 + 5], batch.rows[7]]
    assert out.counts.tolist() == [2, 1, 1] and out.new_last == [5] and seq_of_row[out.rows[0]] == new.seq_id
    assert batch.block_table[batch.rows[7], :3].tolist() == [7, 9, 10] and out.spec.tolist() == [0, 0, 0]
    batch.stopped.add(7)   # a stop token was sampled for 7: left out of later steps
    out = apply(batch, index, wpb.StepRequest(running_seq_ids=[7, 11], running_num_scheduled=[1, 1]),
                seq_of_row, 16, speculating=False)
    assert out.rows.tolist() == [batch.rows[11]]


@pytest.mark.parametrize("step", [
    wpb.StepRequest(running_seq_ids=[8], running_num_scheduled=[1]),            # unknown
    wpb.StepRequest(running_seq_ids=[7, 7], running_num_scheduled=[1, 1]),      # repeated
    wpb.StepRequest(running_seq_ids=[7], running_num_scheduled=[1, 1]),         # lengths
    wpb.StepRequest(running_seq_ids=[7], running_num_scheduled=[1], running_new_block_counts=[2],
                    running_new_block_ids=[3]),                                 # block counts
    wpb.StepRequest(copy_src_blocks=[1], copy_dst_blocks=[16]),                 # out of range
])
def test_bad_deltas_are_refused(step):
    batch, index, seq_of_row = _mirror()
    with pytest.raises(BatchError):
        apply(batch, index, step, seq_of_row, 16, speculating=False)
