"""Late sampling through graphs (``headrace.dataplane.late_sampling``): a step's bitmasks, sampling
arrays and rows written into static buffers and replayed give the tokens ``sampler.sample``
gives (greedy and seeded rows, top-k/top-p and min-p, plain and shared masks, padded rows),
write them into ``last_token`` (padding into the sink) and to the host; a key's graph is
captured once and replayed after; steps it cannot take are left to the sampler. On a worker
over gRPC, constrained steps sampled late through the graphs give the eager worker's tokens.
Off CUDA the graphs are stand-ins over the same buffers; with HEADRACE_TEST_DEVICE=cuda they
are real captures."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported: the CPU interpreter or the GPU
from headrace.dataplane import sampler, staging  # noqa: E402
from headrace.dataplane.late_sampling import LateSampler  # noqa: E402
from headrace.dataplane.sampler import SamplingBatch, SamplingRow  # noqa: E402
from headrace.dataplane.server import serve  # noqa: E402
from headrace.dataplane.worker import Worker, WorkerOptions  # noqa: E402
from headrace.worker.v1 import worker_pb2 as wpb  # noqa: E402
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from tests import graphs  # noqa: E402
from tests.test_dataplane import model_dir  # noqa: E402,F401 (fixture: a qwen3 checkpoint)
from tests.test_structured_dataplane import decode, late, pack, prefill  # noqa: E402

VOCAB, MAX_ROWS = 384, 8
WORDS = VOCAB // 32


def _row(temperature=0.0, seed=None, top_k=0, top_p=1.0, min_p=0.0, logprobs=0, penalty=1.0) -> SamplingRow:
    return SamplingRow(temperature, top_p, top_k, min_p, penalty, 0.0, 0.0, seed, logprobs, 0, [], [1], [])


def _step(rows: list[SamplingRow], masks: list[set[int] | None], shared: bool, rng) -> tuple:
    """(host arrays as the runner uploads them, bitmasks.arrays' masks) of a step."""
    batch = SamplingBatch.of_rows(rows)
    host = {"s_" + k: v for k, v in sampler.device_arrays(batch, rng).items()}
    host["last_rows"] = rng.permutation(MAX_ROWS)[:len(rows)].astype(np.int64)
    constrained = [i for i, m in enumerate(masks) if m is not None]
    bits = np.frombuffer(pack([masks[i] for i in constrained]), "<i4").reshape(len(constrained), WORDS)
    out = {"s_mask_rows": np.asarray(constrained, np.int64)}
    if shared:   # distinct masks once each, and each row's
        table, of = np.unique(bits, axis=0, return_inverse=True)
        out.update(s_mask_bits=table, s_mask_of=of.reshape(-1).astype(np.int64))
    else:
        out["s_mask_bits"] = bits
    return batch, host, out


def _eager(logits, batch, host, masks) -> list[int]:
    dev = staging.upload({k[2:]: v for k, v in (host | masks).items() if k.startswith("s_")}, logits.device)
    return sampler.sample(logits.clone(), batch, dev).token_ids.tolist()


def _late(n_rows: int = MAX_ROWS) -> LateSampler:
    return LateSampler(torch.zeros(n_rows, VOCAB, device=DEVICE), torch.zeros(16, dtype=torch.int64, device=DEVICE))


rows_st = st.lists(st.tuples(st.sampled_from([0.0, 0.7, 1.5]), st.integers(0, 2**40),
                             st.sampled_from([0, 3]), st.sampled_from([1.0, 0.8]), st.sampled_from([0.0, 0.2]),
                             st.one_of(st.none(), st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=40))),
                   min_size=1, max_size=MAX_ROWS)


@settings(max_examples=25, deadline=None)
@given(rows=rows_st, shared=st.booleans(), seed=st.integers(0, 1000))
def test_a_replay_samples_what_the_sampler_samples(rows, shared, seed):
    """Greedy and seeded rows (their tokens depend on nothing else), with and without filters
    and masks: the graph's tokens are the sampler's, in ``last_token`` at the step's rows and
    in the host copy; padded rows wrote into the sink alone."""
    rng = np.random.default_rng(seed)
    late = _late()
    sampling = [_row(t, s, k, p, m) for t, s, k, p, m, _ in rows]
    batch, host, masks = _step(sampling, [r[-1] for r in rows], shared, rng)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    expected = _eager(logits, batch, host, masks)
    for _ in range(2):   # the capture's step, then a replay
        late.last_token.fill_(-1)
        late.logits[:len(rows)] = logits
        out = late.sample(late.logits[:len(rows)], host, masks)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        assert out.to_host()[0] == expected == out.token_ids.tolist()
        written = late.last_token.tolist()
        assert [written[r] for r in host["last_rows"]] == expected
        others = set(range(MAX_ROWS)) - set(host["last_rows"].tolist())
        assert all(written[r] == -1 for r in others)
        assert (written[late.sink] != -1) == (len(rows) not in (1, 2, 4, 8))
    assert late.num_replays == 1 and len(late.graphs) == 1
    for tokens, (*_, allowed) in zip(expected, rows):
        assert allowed is None or tokens in allowed


def test_keys_are_rows_and_masks_buckets_and_filters():
    rng, late = np.random.default_rng(0), _late()
    logits = torch.randn(MAX_ROWS, VOCAB).to(DEVICE)
    for n, masked, top_k in ((3, 1, 0), (4, 2, 0), (4, 3, 0), (4, 3, 5), (5, 1, 0), (2, 0, 0)):
        rows = [_row(0.0, top_k=top_k) for _ in range(n)]
        _, host, masks = _step(rows, [{1, 2}] * masked + [None] * (n - masked), False, rng)
        late.sample(logits[:n], host, masks)
    assert sorted(late.graphs) == [(2, 1, False, False), (4, 1, False, False), (4, 2, False, False),
                                   (4, 4, False, False), (4, 4, True, False), (8, 1, False, False)]
    assert late.num_replays == 0
    # 3 rows, 2 masks: (4, 2) again, replayed; logits not of the static buffer (an eager
    # forward's) are copied in first
    batch, host, masks = _step([_row(0.0)] * 3, [{7, 9}, None, {300}], False, rng)
    logits = torch.randn(3, VOCAB).to(DEVICE)
    expected = _eager(logits, batch, host, masks)
    out = late.sample(logits, host, masks)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    assert late.num_replays == 1 and out.to_host()[0] == expected


@pytest.mark.parametrize("row,verify,n", [(_row(penalty=1.2), False, 2), (_row(logprobs=2), False, 2),
                                          (_row(), True, 2), (_row(), False, MAX_ROWS + 1)])
def test_penalties_logprobs_verifies_and_large_steps_are_left_to_the_sampler(row, verify, n):
    late = _late()
    batch = SamplingBatch.of_rows([row] * n)
    assert not late.takes(torch.zeros(n, VOCAB, device=DEVICE), batch, verify, {})
    assert late.takes(torch.zeros(2, VOCAB, device=DEVICE), SamplingBatch.of_rows([_row()] * 2), False, {})


@pytest.fixture
def stubs(model_dir, tmp_path):
    """Two workers over gRPC on one checkpoint: with step graphs (stand-ins off CUDA) and eager."""
    out, servers, channels = [], [], []
    for name, graphed in (("g", True), ("e", False)):
        worker = Worker(WorkerOptions(model=str(model_dir), num_kv_blocks=32,
                                      **({} if graphed else {"enforce_eager": True})))
        if graphed:
            graphs.attach(worker, "full_decode_only")   # (the decode graphs own the static logits)
        servers.append(serve(worker, f"unix:{tmp_path}/{name}.sock"))
        channels.append(grpc.insecure_channel(f"unix:{tmp_path}/{name}.sock"))
        out.append((worker, wpb_grpc.WorkerStub(channels[-1])))
    yield out
    for c in channels:
        c.close()
    for s in servers:
        s.stop(0).wait()


def test_a_worker_samples_late_steps_through_the_graphs_as_an_eager_worker(stubs):
    masks = [{11, 40, 200, 301}, {3, 99, 250}, {17, 18, 19, 380}, set(range(100, 384))]
    steps = [prefill(temperature=0.0), decode(2, bitmask_follows=True), decode(3, bitmask_follows=True),
             late(2, [masks[0]]), decode(4, bitmask_follows=True), late(3, [masks[1]]),
             late(4, [masks[2]]), decode(5, bitmask_follows=True), late(5, [masks[3]]),
             wpb.StepRequest(step_id=6, flush=True)]
    (graphed, graphed_stub), (eager, eager_stub) = stubs
    tokens = [[list(r.token_ids) for r in stub.Execute(iter(steps))] for stub in (graphed_stub, eager_stub)]
    assert tokens[0] == tokens[1]
    assert all(t[0] in m for t, m in zip(tokens[0][1:5], masks))
    assert graphed.runner._late.num_replays == 3 and eager.runner._late is None
