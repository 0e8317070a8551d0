"""The worker's persistent input batch: flat inputs of mixed steps and rejected deltas."""

from __future__ import annotations

import numpy as np
import pytest

from headrace.dataplane.input_batch import BatchError, InputBatch
from headrace.dataplane.sampler import SamplingRow


def srow(prompt, output=()):
    return SamplingRow(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                       presence_penalty=0.0, frequency_penalty=0.0, seed=None, logprobs=0,
                       min_tokens=0, stop_token_ids=[], prompt_token_ids=list(prompt),
                       output_token_ids=list(output))


def test_mixed_step_inputs():
    b = InputBatch(max_seqs=4, max_model_len=64, block_size=4, num_blocks=16)
    a = b.add(1, srow(range(10, 20)), [3, 5, 7], num_computed=4)     # chunk of a prefill
    c = b.add(2, srow([1, 2], output=[9]), [8], num_computed=2)      # resumed: decode its token
    prep = b.prepare(np.array([a, c]), np.array([6, 1]))
    # a mixed batch puts its one-token rows first (they take the decode attention kernel)
    assert prep.num_decodes == 1
    assert prep.input_ids[1:].tolist() == list(range(14, 20))
    assert prep.last_index.tolist() == [0] and prep.last_rows.tolist() == [c]   # read on the device
    assert prep.positions.tolist() == [2, 4, 5, 6, 7, 8, 9]
    assert prep.slot_mapping.tolist() == [34, 20, 21, 22, 23, 28, 29]
    assert prep.query_start_loc.tolist() == [0, 1, 7] and prep.seq_lens.tolist() == [3, 10]
    assert prep.block_tables.tolist() == [[8, 0, 0], [3, 5, 7]]
    assert prep.logits_indices.tolist() == [0, 6] and prep.sample_rows.tolist() == [c, a]
    assert not prep.decode_only and prep.max_query_len == 6
    assert b.count_sampled(prep.sample_rows) == []     # greedy rows keep no history
    b.append_blocks(np.array([c]), np.array([1]), np.array([9]))
    prep = b.prepare(np.array([a, c]), np.array([1, 1]))
    assert prep.decode_only and prep.last_rows.tolist() == [a, c]
    assert prep.decode_order.tolist() == [0, 1]          # attention starts the longest first
    assert prep.positions.tolist() == [10, 3] and prep.seq_lens.tolist() == [11, 4]
    assert prep.slot_mapping.tolist() == [30, 35] and prep.block_tables.tolist() == [[3, 5, 7], [8, 9, 0]]
    assert prep.sample_rows.tolist() == [a, c] and prep.logits_indices.tolist() == [0, 1]
    b.count_sampled(prep.sample_rows)
    d = b.add(3, srow([7, 8, 9]), [10], num_computed=0)
    prep = b.prepare(np.array([a, d, c]), np.array([1, 3, 1]))
    assert not prep.decode_only and prep.input_ids[2:5].tolist() == [7, 8, 9]
    assert prep.num_decodes == 2 and prep.sample_rows.tolist() == [a, c, d]
    assert prep.seq_lens[:2].tolist() == [12, 5] and prep.decode_order.tolist() == [0, 1]
    assert prep.last_index.tolist() == [0, 1] and prep.last_rows.tolist() == [a, c]
    assert b.sampling_batch(prep.sample_rows).num_output.tolist() == [2, 3, 0]


def test_bad_deltas_are_rejected():
    b = InputBatch(max_seqs=1, max_model_len=16, block_size=4, num_blocks=4)
    row = b.add(1, srow([1, 2, 3]), [0], num_computed=0)
    with pytest.raises(BatchError):
        b.add(1, srow([1]), [1], 0)              # already held
    with pytest.raises(BatchError):
        b.add(2, srow([1]), [1], 0)              # no free row
    with pytest.raises(BatchError):
        b.append_blocks(np.array([row]), np.array([1]), np.array([4]))   # block id out of range
    with pytest.raises(BatchError):
        b.append_blocks(np.array([row]), np.array([4]), np.array([0, 1, 2, 3]))  # past max_model_len
    with pytest.raises(BatchError):
        b.prepare(np.array([row]), np.array([4]))  # beyond its known tokens
    with pytest.raises(BatchError):
        b.row_of(99)
    b.remove(1)
    assert b.add(2, srow([5]), [1], 0) == row


def test_decodes_start_longest_first():
    b = InputBatch(max_seqs=3, max_model_len=64, block_size=4, num_blocks=16)
    rows = [b.add(i, srow(range(n)), list(range(4 * i, 4 * i + 4)), num_computed=n - 1)
            for i, n in enumerate([5, 14, 9])]
    prep = b.prepare(np.array(rows), np.array([1, 1, 1]))
    assert prep.seq_lens.tolist() == [5, 14, 9]
    assert prep.decode_order.tolist() == [1, 2, 0]


def test_the_stop_rule_is_array_work_and_survives_row_reuse():
    b = InputBatch(max_seqs=4, max_model_len=64, block_size=4, num_blocks=16)
    rows = []
    for sid, stops, min_tokens in ((1, [7], 0), (2, [3, 9, 11, 40], 0), (3, [], 0), (4, [7], 2)):
        s = srow([1, 2])
        s.stop_token_ids, s.min_tokens = stops, min_tokens
        rows.append(b.add(sid, s, [sid], num_computed=1))
    rows = np.array(rows)
    assert b.stop_table.shape[1] == 4   # grew to the longest stop list
    b.count_sampled(rows)
    watch = b.stop_watch(rows, np.array([1, 2, 3, 4]))
    assert watch[0].tolist() == [0, 1]          # 3 has no stop ids, 4 needs 2 outputs first
    b.remove(2)                                 # its row is reused before the tokens are known
    s = srow([5])
    s.stop_token_ids = [5]
    b.add(5, s, [5], num_computed=0)
    # both stopped (reported); 2 is gone, so only 1 is left out of the next steps, and 2's
    # stop ids were copied at launch: its row's new stop id (5) does not count
    assert b.mark_stopped(watch, [7, 11, 7, 7]) == [1, 2] and b.stopped == {1}
    assert b.mark_stopped(watch, [7, 5, 7, 7]) == [1] and b.mark_stopped((), []) == []
    assert b.mark_stopped(b.stop_watch(rows[:1], np.array([1])), [8]) == []
