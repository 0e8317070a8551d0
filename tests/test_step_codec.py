"""The control plane's step codec: a scheduled step's wire message, and a result's tokens
and logprobs folded back into the sequences it sampled for."""

from __future__ import annotations

from headrace.controlplane.requests.request import Status
from headrace.controlplane.scheduling.step import NewSeq, RunningSeqs, ScheduledStep
from headrace.controlplane.engine.step_codec import decode, encode, flush_request
from headrace.worker.v1 import worker_pb2 as wpb
from tests.test_scheduler import make_request


def _step():
    a, b, c = (make_request([1, 2, 3, 4, 5], max_tokens=4).sequences[0] for _ in range(3))
    a.num_computed = 2
    b.output_token_ids, b.num_computed = [9], 5
    c.num_computed = 5
    step = ScheduledStep(new=[NewSeq(a, 3, (4, 5))],
                         running=RunningSeqs(seqs=[b, c], num_tokens=[1, 1], new_block_counts=[0, 2],
                                             new_block_ids=[7, 8]),
                         finished_seq_ids=[11], copies=[(1, 2), (3, 4)])
    return step, a, b, c


def test_encode_carries_every_field_of_the_step():
    step, a, b, c = _step()
    msg = encode(step, 42, flush=True)
    assert (msg.step_id, msg.flush, list(msg.finished_seq_ids)) == (42, True, [11])
    assert (list(msg.copy_src_blocks), list(msg.copy_dst_blocks)) == ([1, 3], [2, 4])
    (new,) = msg.new_seqs
    assert (new.seq_id, list(new.prompt_token_ids), list(new.block_ids)) == (a.seq_id, [1, 2, 3, 4, 5], [4, 5])
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (2, 3)
    assert list(msg.running_seq_ids) == [b.seq_id, c.seq_id]
    assert list(msg.running_num_scheduled) == [1, 1]
    assert (list(msg.running_new_block_counts), list(msg.running_new_block_ids)) == ([0, 2], [7, 8])
    assert not encode(ScheduledStep(), 43, flush=False).running_seq_ids
    assert flush_request(44) == wpb.StepRequest(step_id=44, flush=True)


def test_decode_appends_tokens_and_logprobs_and_drops_finished_sequences():
    step, a, b, c = _step()
    a.sampling.logprobs, b.sampling.logprobs, c.sampling.logprobs = 2, 1, 1
    for seq in (a, b, c):
        seq.num_inflight = 1
    b.status = Status.FINISHED   # aborted while the step was in flight: its top entries are skipped
    result = wpb.StepResult(seq_ids=[a.seq_id, b.seq_id, c.seq_id], token_ids=[20, 21, 22],
                            logprobs=[-0.5, -0.25, -0.75], top_token_ids=[20, 5, 99, 22],
                            top_logprobs=[-0.5, -2.0, -1.0, -0.75])
    assert decode(step, result) == [a, c]
    assert a.output_token_ids == [20] and c.output_token_ids == [22] and b.output_token_ids == [9]
    assert (a.num_inflight, b.num_inflight, c.num_inflight) == (0, 1, 0)
    assert [(v, list(ids), list(vals)) for v, ids, vals in a.logprobs] == [(-0.5, [20, 5], [-0.5, -2.0])]
    assert [(v, list(ids), list(vals)) for v, ids, vals in c.logprobs] == [(-0.75, [22], [-0.75])]
    assert b.logprobs == []
