"""Host-tier loads ahead of compute (headrace.controlplane.kv.prefetch through the scheduler): while
another sequence runs, a host hit's copies go out at once and its sequence is computed only once
they should have landed, loads queue on one link, a step with only loads to start is sent, a
deferred sequence gives its blocks back before a running one is preempted (its loaded prefix stays
cached on the device), an abort or a reset leaves nothing behind, queued sequences beyond the budget
start their loads, and a swap-preempted sequence resumes the same way. The workers' side (a step
waits only for the blocks it reads): tests/test_kv_transfer.py; random workloads with deferral:
tests/test_host_tier_workloads.py."""

from __future__ import annotations

from headrace.controlplane.requests.request import Status
from headrace.controlplane.kv.tier_cost import TierCost
from headrace.v1 import inference_pb2 as pb
from tests.test_host_tier import _run, _sched
from tests.test_scheduler import make_request, run_step

PROMPT = list(range(1, 10))   # 9 tokens, blocks of 4: 2 full blocks to find again


def _on_host(blocks=8, host=32, load=1.0, budget=64):
    """A scheduler whose host tier holds PROMPT's 2 full blocks (evicted by a filler); loading
    a block costs ``load`` seconds, recomputing a token 1 s (so hits are loaded)."""
    sched = _sched(blocks=blocks, host=host, budget=budget, cost=TierCost("auto", load, 4, 1.0))
    _run(sched, PROMPT)
    _run(sched, list(range(50, 50 + 4 * blocks - 3)))   # every device block: PROMPT's go to the host
    assert len(sched.blocks.host.cached) == 2 and not sched.blocks.match_prefix(PROMPT)[0] >= 0
    return sched


def _start(sched, prompt, max_tokens):
    req = make_request(prompt, max_tokens=max_tokens)
    sched.add(req.sequences)
    return req.sequences[0]


def test_a_host_hit_loads_while_others_run_and_is_computed_once_landed():
    sched = _on_host(load=1.0)
    runner = _start(sched, [40, 41, 42], 20)
    run_step(sched)
    seq = _start(sched, PROMPT, 2)
    step = run_step(sched)
    assert len(step.swap_in) == 2 and [r.seq for r in step.new] == []   # loads out, no compute
    assert seq.status is Status.WAITING and len(sched.blocks.block_ids(seq.seq_id)) == 2
    assert seq.num_computed == 8 and seq.num_cached_prompt_tokens == 8
    assert sched.prefetch.ready_at[seq.seq_id] == 2.0   # 2 blocks x 1 s from t = 0
    for _ in range(3):   # the clock stands: its loads are not done
        step = run_step(sched)
        assert step.running.seqs == [runner] and not step.new and not step.swap_in
    sched.clock.now = 2.0
    step = run_step(sched)
    assert [(r.seq, r.num_tokens) for r in step.new] == [(seq, 1)] and not step.swap_in
    assert seq.seq_id not in sched.prefetch.ready_at and sched.prefetch.num_deferred == 1
    assert sched.blocks.host.hits == 8   # loaded, not recomputed


def test_with_nothing_running_a_host_hit_is_loaded_and_computed_in_one_step():
    sched = _on_host(load=1.0)
    seq = _start(sched, PROMPT, 2)
    step = run_step(sched)
    assert len(step.swap_in) == 2 and [(r.seq, r.num_tokens) for r in step.new] == [(seq, 1)]
    assert sched.prefetch.num_deferred == 0 and sched.retry_after is None


def test_loads_queue_on_one_link_and_a_step_of_loads_only_is_sent():
    sched = _on_host(blocks=12, load=1.0)
    _run(sched, list(range(100, 109)))
    _run(sched, list(range(200, 245)))   # evicts the second prompt's 2 blocks too
    runner = _start(sched, [40, 41, 42], 2)
    run_step(sched)
    sched.after_step(sched.schedule())   # its last token is in flight: nothing to compute
    assert runner.num_inflight == 1 and not runner.may_sample_more
    sched.clock.now = 10.0
    a, b = _start(sched, PROMPT, 2), _start(sched, list(range(100, 109)), 2)
    step = sched.schedule()
    assert not step.empty and not step.new and not step.running.seqs and len(step.swap_in) == 4
    assert sched.prefetch.ready_at == {a.seq_id: 12.0, b.seq_id: 14.0}   # one after the other
    assert sched.retry_after == 2.0   # the engine looks again when the first lands


def test_a_deferred_sequence_gives_its_blocks_back_before_a_running_one_is_preempted():
    sched = _on_host(blocks=8, load=1.0)
    runner = _start(sched, [40, 41, 42], 26)   # grows to all 8 blocks over its 29 tokens
    run_step(sched)
    seq = _start(sched, PROMPT, 2)
    run_step(sched)
    held = sched.blocks.block_ids(seq.seq_id)
    assert len(held) == 2
    for _ in range(30):   # the clock stands: its loads never land while the runner grows
        if runner.finished:
            break
        run_step(sched)
    assert runner.finished and sched.num_preemptions == 0   # the deferred blocks went first
    assert not sched.blocks.block_ids(seq.seq_id) and seq.num_computed == 0
    assert seq.status is Status.WAITING and not sched.prefetch.ready_at
    sched.clock.now = 100.0
    for _ in range(10):
        if seq.finished:
            break
        run_step(sched)
    assert seq.finished and seq.num_cached_prompt_tokens == 8


def test_an_aborted_deferred_sequence_and_a_reset_leave_no_block_behind():
    sched = _on_host(load=1.0)
    runner = _start(sched, [40, 41, 42], 20)
    run_step(sched)
    seq = _start(sched, PROMPT, 2)
    run_step(sched)
    assert sched.blocks.block_ids(seq.seq_id)
    sched.finish(seq, pb.FINISH_REASON_ABORTED)
    assert not sched.blocks.block_ids(seq.seq_id) and not sched.prefetch.ready_at
    again = _start(sched, PROMPT, 2)
    run_step(sched)
    assert sched.blocks.block_ids(again.seq_id)   # deferred again: its loads go out again
    sched.reset()
    assert not sched.blocks.block_ids(again.seq_id) and not sched.prefetch.ready_at
    assert again.num_computed == 0 and runner.status is Status.WAITING
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_queued_sequences_beyond_the_budget_start_their_loads():
    sched = _on_host(load=1.0, budget=4)
    runner = _start(sched, [40, 41, 42, 43, 44, 45, 46], 20)   # 7 tokens: 2 steps of prefill
    run_step(sched)
    seq = _start(sched, PROMPT, 2)
    step = sched.schedule()   # the runner's 3 tokens ... and the budget's last token
    sched.after_step(step)
    assert len(step.swap_in) == 2 and seq.seq_id in sched.prefetch.ready_at
    assert runner in step.running.seqs


def test_a_swapped_sequence_resumes_by_loads_ahead_of_its_compute():
    sched = _sched(blocks=12, host=16, mode="swap", budget=64, cost=TierCost("auto", 1.0, 4, 1.0))
    bystander = _start(sched, [90], 20)               # oldest: runs throughout, 6 blocks at the end
    other = _start(sched, list(range(1, 8)), 12)      # 7 + 12 tokens: 5 blocks
    swapped = _start(sched, list(range(20, 27)), 12)  # the newest: preempted when blocks run out
    resumed = None
    for _ in range(100):
        if not sched.has_work:
            break
        sched.clock.now += 0.25
        step = run_step(sched)
        if resumed is None and step.swap_in:
            resumed = step
            assert swapped.status is Status.WAITING and sched.blocks.block_ids(swapped.seq_id)
            assert swapped not in [r.seq for r in step.new] and bystander in step.running.seqs
    assert sched.num_preemptions and sched.prefetch.num_deferred >= 1 and resumed is not None
    assert bystander.finished and other.finished and swapped.finished
    assert sched.blocks.num_free == 12 and sched.blocks.host.num_free == 16
