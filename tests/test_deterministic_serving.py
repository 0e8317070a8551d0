"""``--deterministic`` end to end on the test device (the CPU's reference kernels; the GPU's
Triton kernels with HEADRACE_TEST_DEVICE=cuda): the control plane's engine drives a data
plane worker in this process, and every request's tokens AND logprobs are bit-identical to the
same request run alone, whatever the workload (property tests draw batch mixes, chunk sizes,
prefix-cache hits, arrivals and a KV pool small enough to preempt), with n-gram speculation,
on a restarted or second data plane (a data-parallel replica), and through the gRPC API, which
reports the mode; what the mode refuses fails clearly."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headrace.controlplane.scheduling.chunking import Chunking
from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.kernels import batch_invariant
from tests.checkpoints import make_checkpoint
from tests.det_harness import MAX_TOKENS, alone, make_request, serve, serve_waves
from tests.harness import DEVICE, Planes

DTYPE = "bfloat16" if DEVICE.startswith("cuda") else "float32"
POOL = 24          # KV blocks of 16 tokens: a few requests fill it (preemption by recompute)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", heads=4, kv_heads=2,
                           head_dim=32, layers=2, vocab=512)


@pytest.fixture(scope="module", autouse=True)
def _default_kernels_after():
    yield
    batch_invariant.enable(False)   # the process's other tests run the default kernels


def _worker(model_dir, **fields) -> Worker:
    opts = dict(model=str(model_dir), device=DEVICE, dtype=DTYPE, num_kv_blocks=POOL,
                max_num_seqs=16, max_batched_tokens=MAX_TOKENS, deterministic=True)
    return Worker(WorkerOptions(**(opts | fields)))


@pytest.fixture(scope="module")
def worker(model_dir):
    return _worker(model_dir)


SHARED = [(7 * i) % 500 + 3 for i in range(40)]   # a prefix some prompts start with


@st.composite
def requests(draw):
    prefix = SHARED[:draw(st.sampled_from([0, 16, 33, 40]))]
    prompt = prefix + draw(st.lists(st.integers(3, 500), min_size=1, max_size=70))
    temperature = draw(st.sampled_from([0.0, 0.9]))
    seed = draw(st.none() | st.integers(0, 1 << 40))
    return make_request(prompt, draw(st.integers(1, 6)), temperature, seed)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(waves=st.lists(st.lists(requests(), min_size=1, max_size=4), min_size=1, max_size=2),
       budget=st.sampled_from([16, 24, 64, MAX_TOKENS]), running=st.sampled_from([2, 4, 16]),
       depth=st.sampled_from([1, 3]))
def test_every_request_gives_the_tokens_and_logprobs_it_gives_alone(worker, waves, budget,
                                                                    running, depth):
    """Batch mixes, chunk sizes (a step budget of 16-64 tokens chunks most prompts), shared
    prefixes (cache hits between the requests), a second wave arriving mid-generation, a pool
    of 24 blocks (preemptions), with and without overlapped steps."""
    got = serve(worker, waves, max_running=running, max_batched_tokens=budget,
                pipeline_depth=depth, chunking=Chunking(max_prefill_tokens_with_decodes=budget))
    flat = [m for wave in waves for m in wave]
    for message, samples in zip(flat, got):
        assert samples == alone(worker, message)


def test_preempted_and_recomputed_requests_give_the_tokens_they_give_alone(worker):
    """Six requests of ~100 tokens each on a pool of 24 blocks: the scheduler preempts (by
    recompute: a victim's prompt and generated tokens are prefilled again, in other chunks)."""
    messages = [make_request([(13 * i + j) % 500 + 3 for j in range(90 + 5 * i)], 12, 0.9 * (i % 2), i)
                for i in range(6)]
    engine_outs, preemptions = asyncio.run(serve_waves(worker, [messages], EngineConfig(
        max_running=6, max_batched_tokens=48, chunking=Chunking(max_prefill_tokens_with_decodes=48))))
    assert preemptions > 0
    for message, samples in zip(messages, engine_outs):
        assert samples == alone(worker, message)


def test_unseeded_samples_are_reproducible_and_n_samples_differ(worker):
    message = make_request(list(range(3, 40)), 8, 1.0, None, n=2)
    first = serve(worker, [[message]], max_running=4)[0]
    again = serve(worker, [[message, make_request([9] * 20, 5, 1.0, None)]], max_running=4)[0]
    assert first == again
    assert first[0] != first[1]    # sample i takes seed DEFAULT_SEED + i


def test_a_restarted_or_second_data_plane_and_ngram_speculation_give_the_same_bits(worker,
                                                                                 model_dir):
    messages = [make_request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7] * 3, 10, 0.0, None),
                make_request(list(range(40, 90)), 9, 0.9, 3)]
    expected = [alone(worker, m) for m in messages]
    replica = _worker(model_dir)   # a fresh worker: a data-plane restart, or replica 2 of -dp 2
    assert serve(replica, [messages], max_running=4, max_batched_tokens=32) == expected
    spec = _worker(model_dir, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}))
    assert serve(spec, [messages], max_running=4, max_batched_tokens=64) == expected
    assert spec.runner.spec is not None


def test_what_the_mode_refuses_and_a_mismatched_control_plane_fail_clearly(model_dir):
    with pytest.raises(ValueError, match="--deterministic: quantized weights"):
        _worker(model_dir, quantization="int8")
    with pytest.raises(ValueError, match="--attention-backend flash-attn"):
        _worker(model_dir, attention_backend="flash-attn")
    with pytest.raises(ValueError, match="--deterministic: the LoRA update"):
        _worker(model_dir, enable_lora=True)
    default = _worker(model_dir, deterministic=False)
    assert not batch_invariant.ENABLED and not default.describe().deterministic

    async def start():
        engine = Engine(InProcessWorkerGroup(default), EngineConfig(deterministic=True))
        await engine.start(timeout=60)

    with pytest.raises(ValueError, match="start it with --deterministic"):
        asyncio.run(start())


def test_the_api_reports_the_mode(model_dir):
    planes = Planes(model_dir, num_kv_blocks=64, worker_fields={"deterministic": True,
                                                                "dtype": DTYPE},
                    config=EngineConfig(deterministic=True),
                    plane_options={"admin_insecure_loopback": True, "http_port": 0})
    try:
        assert planes.stub.GetModelInfo(pb.GetModelInfoRequest()).deterministic
        admin = apb_grpc.AdminStub(planes.channel)
        assert admin.GetConfig(apb.GetConfigRequest()).deterministic
        with urllib.request.urlopen(f"http://127.0.0.1:{planes.plane.http.port}/v1/models") as r:
            assert json.load(r)["data"][0]["deterministic"] is True
        with pytest.raises(grpc.RpcError):   # (a live server: bad input still fails per request)
            planes.generate(prompt_token_ids=pb.TokenIds(ids=[]), max_tokens=1)
    finally:
        planes.close()
