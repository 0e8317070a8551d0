"""Structured outputs in the data plane: the token-bitmask kernel against its torch reference
(and the reference against the bit layout), the step protocol's bitmasks (inline, and
``bitmask_follows`` + ``late_bitmask``: the step is launched, sampled when its bitmasks come,
and answered in order, at once when its forward pass is done) on a worker over gRPC, its
refusals, and ``headrace.dataplane.bitmasks``."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
import headrace.kernels.reference as ref  # noqa: E402
from headrace.dataplane import bitmasks  # noqa: E402
from headrace.dataplane.input_batch import BatchError  # noqa: E402
from headrace.worker.v1 import worker_pb2 as wpb  # noqa: E402
from tests.test_dataplane import model_dir, worker_stub  # noqa: E402,F401 (fixtures: a qwen3 worker)

VOCAB = 384
WORDS = VOCAB // 32


def pack(allowed_rows: list[set[int]], vocab: int = VOCAB) -> bytes:
    bits = np.zeros((len(allowed_rows), (vocab + 31) // 32 * 32), dtype=bool)
    for i, allowed in enumerate(allowed_rows):
        bits[i, sorted(allowed)] = True
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


# -- the kernel ---------------------------------------------------------------------------------
def test_the_reference_follows_the_bit_layout():
    logits = torch.zeros(3, 70)
    bits = torch.from_numpy(np.frombuffer(pack([{0, 31, 32, 69}, {5}], 70), dtype="<i4").reshape(2, 3).copy())
    ref.apply_token_bitmask(logits, bits, torch.tensor([2, 0]))
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[1]).all()   # a row without a bitmask is untouched


@settings(max_examples=12, deadline=None)
@given(vocab=st.integers(1, 9000), n_rows=st.integers(1, 5), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_triton_bitmask_matches_the_reference(vocab, n_rows, seed, dtype):
    from headrace.kernels import triton_bitmask

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows + 2, vocab, generator=g).to(dtype).to(DEVICE)
    words = (vocab + 31) // 32
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n_rows, words), generator=g, dtype=torch.int32).to(DEVICE)
    rows = torch.randperm(n_rows + 2, generator=g)[:n_rows].to(DEVICE)
    expected, actual = logits.clone(), logits.clone()
    ref.apply_token_bitmask(expected, bits, rows)
    triton_bitmask.apply_token_bitmask(actual, bits, rows)
    assert torch.equal(actual.cpu(), expected.cpu())


def test_bitmask_arrays_map_sequences_to_sampling_rows():
    msg = wpb.TokenBitmask(seq_ids=[7, 3, 9], bits=pack([{1}, {2}, {3}]))
    out = bitmasks.arrays(msg, np.array([3, 5, 7]), None, VOCAB)
    assert out["s_mask_rows"].tolist() == [2, 0]   # 9 does not sample in this step: skipped
    assert out["s_mask_bits"].shape == (2, WORDS) and out["s_mask_bits"][0, 0] == 2
    verify = bitmasks.arrays(msg, np.array([3, 7]), np.array([2, 0]), VOCAB)   # 3 has 1 + 2 rows
    assert verify["s_mask_rows"].tolist() == [3, 0]
    with pytest.raises(BatchError, match="bytes for 3 rows"):
        bitmasks.arrays(wpb.TokenBitmask(seq_ids=[7, 3, 9], bits=b"\0" * 12), np.array([3]), None, VOCAB)


# -- the step protocol on a worker ------------------------------------------------------------
def prefill(step_id=1, seq_id=1, temperature=1.0, flush=False, **fields):
    step = wpb.StepRequest(step_id=step_id, flush=flush, **fields)
    step.new_seqs.add(seq_id=seq_id, prompt_token_ids=[5, 6, 7], block_ids=[0],
                      num_scheduled_tokens=3, sampling=wpb.Sampling(top_p=1, repetition_penalty=1,
                                                                    temperature=temperature))
    return step


def decode(step_id, seq_id=1, flush=False, **fields):
    return wpb.StepRequest(step_id=step_id, running_seq_ids=[seq_id], running_num_scheduled=[1],
                           running_new_block_counts=[0], flush=flush, **fields)


def test_an_inline_bitmask_constrains_the_sample(worker_stub):
    allowed = {17, 250, 383}
    for t in (0.0, 1.0, 5.0):
        step = prefill(temperature=t, flush=True,
                       bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([allowed])))
        (result,) = list(worker_stub.Execute(iter([step])))
        assert result.token_ids[0] in allowed


def test_late_bitmasks_complete_a_launched_step_in_order(worker_stub):
    """Step 2 is sent while step 1 is in flight, its bitmask promised; the next message
    brings it. The results come in step order; the late message has none of its own."""
    only = {42}
    steps = [prefill(temperature=1.0),
             decode(2, bitmask_follows=True),
             wpb.StepRequest(step_id=2, late_bitmask=True, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([only]))),
             decode(3, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([{7}]))),
             wpb.StepRequest(step_id=4, flush=True)]
    results = list(worker_stub.Execute(iter(steps)))
    assert [r.step_id for r in results] == [1, 2, 3, 4]
    assert list(results[1].token_ids) == [42] and list(results[2].token_ids) == [7]


def test_a_late_masked_step_whose_forward_is_done_is_answered_before_the_next_step(worker_stub):
    """Its forward pass is done when its bitmasks come (always on a CPU): the worker answers
    it at once, since the control plane waits for its token to compute the next bitmasks, and
    does not hold it until the next step arrives."""
    answered, flushed = threading.Event(), threading.Event()

    def steps():
        yield prefill(temperature=1.0)
        yield decode(2, bitmask_follows=True)
        yield wpb.StepRequest(step_id=2, late_bitmask=True, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([{9}])))
        answered.wait(10)   # (a GPU whose forward pass still ran holds it: the flush ends the wait)
        flushed.set()
        yield wpb.StepRequest(step_id=3, flush=True)

    results = []
    for r in worker_stub.Execute(steps()):
        results.append(r)
        if r.step_id == 2:
            early = not flushed.is_set()
            answered.set()
    assert [r.step_id for r in results] == [1, 2, 3] and list(results[1].token_ids) == [9]
    if DEVICE == "cpu":
        assert early


def test_late_bitmasks_of_a_step_whose_rows_stopped_complete_nothing(worker_stub):
    """Step 2's token is a stop token and step 2 is answered before step 3 comes (on a CPU):
    step 3 runs nothing, and its promised bitmasks are still taken."""
    first = prefill(temperature=1.0)
    first.new_seqs[0].sampling.stop_token_ids.append(9)
    steps = [first,
             decode(2, bitmask_follows=True),
             wpb.StepRequest(step_id=2, late_bitmask=True, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([{9}]))),
             decode(3, bitmask_follows=True),
             wpb.StepRequest(step_id=3, late_bitmask=True, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=pack([{5}]))),
             wpb.StepRequest(step_id=4, flush=True)]
    results = list(worker_stub.Execute(iter(steps)))
    assert [r.step_id for r in results] == [1, 2, 3, 4]
    assert list(results[1].token_ids) == [9] and list(results[1].stopped_seq_ids) == [1]
    # (on a GPU whose forward pass still ran, step 2 was answered after step 3's launch: then
    # step 3 sampled the row, under its late bitmask)
    assert not results[2].token_ids if DEVICE == "cpu" else list(results[2].token_ids) in ([], [5])


def late(step_id, allowed_rows, seq_ids=(1,)):
    return wpb.StepRequest(step_id=step_id, late_bitmask=True,
                           bitmask=wpb.TokenBitmask(seq_ids=list(seq_ids), bits=pack(allowed_rows)))


def test_a_step_sent_before_the_bitmasks_is_launched_after_them_and_samples_the_same(worker_stub):
    """The control plane sends step 3 before step 2's bitmasks (three steps in flight): the
    worker prepares it while step 2 waits and launches it once step 2 has sampled. Greedy
    tokens under masks of several tokens are those of the order without it, and every result
    comes, in step order."""
    masks = [{11, 40, 200, 301}, {3, 99, 250}, {17, 18, 19, 380}]

    def run(ahead: bool) -> list[wpb.StepResult]:
        first = prefill(temperature=0.0)
        d2, d3 = decode(2, bitmask_follows=True), decode(3, bitmask_follows=True)
        steps = [first, d2, d3, late(2, [masks[0]]), decode(4, bitmask_follows=True), late(3, [masks[1]]),
                 late(4, [masks[2]])] if ahead else \
            [first, d2, late(2, [masks[0]]), d3, late(3, [masks[1]]), decode(4, bitmask_follows=True),
             late(4, [masks[2]])]
        return list(worker_stub.Execute(iter(steps + [wpb.StepRequest(step_id=5, flush=True)])))

    before, after = run(False), run(True)
    assert [r.step_id for r in after] == [1, 2, 3, 4, 5]
    tokens = [list(r.token_ids) for r in after]
    assert tokens == [list(r.token_ids) for r in before]
    assert all(t[0] in m for t, m in zip(tokens[1:4], masks))


def test_a_step_prepared_ahead_may_reuse_the_row_of_a_sequence_the_waiting_step_samples(worker_stub):
    """Step 3 comes while step 2 waits for its bitmasks, finishes sequence 1 (a stop string
    the control plane saw) and starts sequence 5, which may take sequence 1's row: step 2's
    tokens still go to sequences 1 and 2, and sequence 5 starts from its own prompt."""
    first = prefill(temperature=0.0, seq_id=1)
    first.new_seqs.add(seq_id=2, prompt_token_ids=[8, 9], block_ids=[1], num_scheduled_tokens=2,
                       sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    d2 = wpb.StepRequest(step_id=2, running_seq_ids=[1, 2], running_num_scheduled=[1, 1],
                         running_new_block_counts=[0, 0], bitmask_follows=True)
    d3 = wpb.StepRequest(step_id=3, finished_seq_ids=[1], running_seq_ids=[2], running_num_scheduled=[1],
                         running_new_block_counts=[0])
    d3.new_seqs.add(seq_id=5, prompt_token_ids=[30, 31, 32], block_ids=[2], num_scheduled_tokens=3,
                    sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    steps = [first, d2, d3, late(2, [{21}, {22}], seq_ids=(1, 2)), wpb.StepRequest(step_id=4, flush=True)]
    results = list(worker_stub.Execute(iter(steps)))
    assert [r.step_id for r in results] == [1, 2, 3, 4]
    assert list(results[1].seq_ids) == [1, 2] and list(results[1].token_ids) == [21, 22]
    assert sorted(results[2].seq_ids) == [2, 5]
    alone = prefill(temperature=0.0, seq_id=5, flush=True)
    alone.new_seqs[0].prompt_token_ids[:] = [30, 31, 32]
    (expected,) = list(worker_stub.Execute(iter([alone])))
    assert dict(zip(results[2].seq_ids, results[2].token_ids))[5] == expected.token_ids[0]


def test_masks_shared_by_several_rows_constrain_each_row(worker_stub):
    """The shared form (``mask_of``): three distinct masks for eight sequences, uploaded once
    each and gathered on the device; every sequence samples inside its own mask."""
    from headrace.controlplane.structured import shared_masks   # the engine's packing, as sent

    allowed = [{3}, {100, 200}, set(range(300, 384))]
    choice = [0, 1, 2, 1, 0, 2, 2, 1]
    step = wpb.StepRequest(step_id=1, flush=True)
    for k in range(len(choice)):
        step.new_seqs.add(seq_id=10 + k, prompt_token_ids=[5 + k, 6, 7], block_ids=[k],
                          num_scheduled_tokens=3, sampling=wpb.Sampling(top_p=1, repetition_penalty=1,
                                                                        temperature=1.0))
    rows = np.frombuffer(pack([allowed[c] for c in choice]), dtype="<i4").reshape(len(choice), WORDS)
    step.bitmask.seq_ids.extend(range(10, 10 + len(choice)))
    shared_masks.pack(rows, step.bitmask, shared_from=0)
    assert list(step.bitmask.mask_of) == [0, 1, 2, 1, 0, 2, 2, 1]
    (result,) = list(worker_stub.Execute(iter([step])))
    tokens = dict(zip(result.seq_ids, result.token_ids))
    assert all(tokens[10 + k] in allowed[c] for k, c in enumerate(choice))


def test_greedy_under_a_mask_that_allows_the_free_choice_is_unchanged(worker_stub):
    (free,) = list(worker_stub.Execute(iter([prefill(temperature=0.0, flush=True)])))
    token = free.token_ids[0]
    masked = prefill(temperature=0.0, flush=True, seq_id=2,
                     bitmask=wpb.TokenBitmask(seq_ids=[2], bits=pack([{token, (token + 1) % VOCAB}])))
    (result,) = list(worker_stub.Execute(iter([masked])))
    assert result.token_ids[0] == token


@pytest.mark.parametrize("steps,words", [
    ([wpb.StepRequest(step_id=1, late_bitmask=True)], "waits for none"),
    ([prefill(), decode(2, bitmask_follows=True), decode(3), decode(4)], "came before the bitmasks"),
    ([prefill(flush=True, bitmask=wpb.TokenBitmask(seq_ids=[1], bits=b"\0" * 8))], "bitmask"),
    ([prefill(), decode(2, bitmask_follows=True), wpb.StepRequest(step_id=5, late_bitmask=True)], "waits for none"),
])
def test_protocol_mistakes_are_refused(worker_stub, steps, words):
    with pytest.raises(grpc.RpcError) as info:
        list(worker_stub.Execute(iter(steps)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
