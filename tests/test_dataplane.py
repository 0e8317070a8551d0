"""The data plane worker over gRPC: Describe, step validation, stream supersession, and the
control plane's reaction to a worker that disappears and comes back."""

from __future__ import annotations

import concurrent.futures

import time

import grpc
import pytest

from headrace.dataplane.server import serve
from headrace.dataplane.worker import Worker, WorkerOptions
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc
from headrace.v1 import inference_pb2 as pb


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", heads=4, kv_heads=2, head_dim=32)


@pytest.fixture
def worker_stub(model_dir, tmp_path):
    server = serve(Worker(WorkerOptions(model=str(model_dir), num_kv_blocks=32)), f"unix:{tmp_path}/w.sock")
    channel = grpc.insecure_channel(f"unix:{tmp_path}/w.sock")
    yield wpb_grpc.WorkerStub(channel)
    channel.close()
    server.stop(0).wait()


def test_describe_reports_model_and_kv(worker_stub):
    info = worker_stub.Describe(wpb.DescribeRequest())
    assert info.architecture == "Qwen3ForCausalLM" and info.num_kv_blocks == 32
    assert info.block_size == 16 and info.vocab_size == 384 and info.world_size == 1
    assert info.kv_bytes_per_block == 2 * 2 * 16 * 2 * 32 * 4
    assert list(info.eos_token_ids) == [1]


def _prefill(seq_id=1, blocks=(0,)):
    step = wpb.StepRequest(step_id=1)
    step.new_seqs.add(seq_id=seq_id, prompt_token_ids=[5, 6, 7], block_ids=list(blocks),
                      num_scheduled_tokens=3, sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    return step


@pytest.mark.parametrize("bad", [
    wpb.StepRequest(step_id=2, running_seq_ids=[99], running_num_scheduled=[1]),
    _prefill(blocks=()),
    _prefill(blocks=(32,)),
])
def test_inconsistent_steps_are_rejected(worker_stub, bad):
    with pytest.raises(grpc.RpcError) as info:
        list(worker_stub.Execute(iter([bad])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_running_delta_continues_a_sequence_and_new_stream_forgets_it(worker_stub):
    decode = wpb.StepRequest(step_id=2, running_seq_ids=[1], running_num_scheduled=[1],
                             running_new_block_counts=[0])
    results = list(worker_stub.Execute(iter([_prefill(), decode])))
    assert [list(r.seq_ids) for r in results] == [[1], [1]]
    # a fresh stream (a restarted control plane) starts from an empty mirror
    with pytest.raises(grpc.RpcError) as info:
        list(worker_stub.Execute(iter([decode])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_requests_survive_a_data_plane_outage(model_dir):
    """The data plane goes away mid-generation and comes back: the control plane keeps every
    request, recomputes it from its prompt and the tokens already streamed, and the outputs
    equal an undisturbed run; KV blocks are back to their baseline afterwards."""
    planes = Planes(model_dir, num_kv_blocks=64)
    try:
        jobs = [(list(range(3 + i, 20 + 2 * i)), 24) for i in range(8)]

        def run(job):
            prompt, n = job
            return completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n,
                                              ignore_eos=True, sampling=pb.SamplingParams(temperature=0)))

        undisturbed = [run(j) for j in jobs]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(run, j) for j in jobs]
            deadline = time.monotonic() + 20
            while (len(planes.engine.requests) < len(jobs) or planes.engine.scheduler.blocks.num_free == 64) \
                    and time.monotonic() < deadline:
                time.sleep(0.002)   # wait until every request is in and generation is under way
            planes.worker_server.stop(0).wait()
            time.sleep(0.5)
            assert not planes.engine.healthy and len(planes.engine.requests) > 0
            planes.worker_server = serve(planes.worker, planes.worker_address)
            disturbed = [f.result(timeout=60) for f in futures]
        assert disturbed == undisturbed
        assert planes.wait_for_free_blocks(64) == 64
    finally:
        planes.close()


def test_requests_fail_with_unavailable_after_the_outage_deadline(model_dir):
    from headrace.controlplane.engine.loop import EngineConfig

    planes = Planes(model_dir, num_kv_blocks=64,
                    config=EngineConfig(outage_deadline_s=0.5, reconnect_interval_s=0.1))
    try:
        planes.worker_server.stop(0).wait()
        with pytest.raises(grpc.RpcError) as info:
            planes.generate(prompt="the quick", max_tokens=50, ignore_eos=True)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert planes.free_blocks == 64 and not planes.engine.requests
    finally:
        planes.close()


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_a_stop_token_leaves_the_sequence_out_of_steps_sent_before_it_was_seen(model_dir, min_tokens):
    """Three steps in flight: step 3 was sent before the control plane saw step 1's token. Every
    id is a stop token here: the worker reports the sequence stopped (stopped_seq_ids) by the
    first token that is out once min_tokens outputs are, and leaves it out of step 3. Without
    min_tokens, step 2 runs too (the one wasted slot: it was launched before step 1 finished);
    with it, the stop ids are masked until then, a penalty that makes each step wait for the
    one before, so the verdict comes at step 2 before step 3 starts."""
    from headrace.dataplane.pipeline import StepPipeline

    worker = Worker(WorkerOptions(model=str(model_dir), num_kv_blocks=32))
    pipeline = StepPipeline(worker.runner)
    first = _prefill()
    first.new_seqs[0].sampling.stop_token_ids.extend(range(384))
    first.new_seqs[0].sampling.min_tokens = min_tokens
    decode = [wpb.StepRequest(step_id=i, running_seq_ids=[1], running_num_scheduled=[1],
                              running_new_block_counts=[0]) for i in (2, 3)]
    results = [r for step in [first, *decode] for r in pipeline.submit(step)] + pipeline.drain()
    assert [r.step_id for r in results] == [1, 2, 3]
    assert [list(r.seq_ids) for r in results] == [[1], [1], []]
    stopped = [[1], [1], []] if min_tokens == 0 else [[], [1], []]
    assert [list(r.stopped_seq_ids) for r in results] == stopped