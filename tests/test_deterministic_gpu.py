"""``--deterministic`` on a GPU (skipped without one; ``bash bench/gpu_run.sh dettests`` runs it):
a model with Qwen3-0.6B's attention layout (16 query heads, 8 KV heads of 128) in bfloat16,
served by the compiled Triton kernels inside CUDA graphs. Many requests at once (mixed greedy
and seeded sampled ones, prompts past one attention split), each against itself alone: tokens
and logprobs bit-identical, under every ``--cudagraph-mode`` (decode graphs, piecewise graphs,
full graphs with the unified kernel, eager), with an FP8 KV cache, and over long contexts
(several splits of a decode spread over programs, then folded)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()
pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")

from headrace.dataplane.worker import Worker, WorkerOptions  # noqa: E402
from headrace.kernels import batch_invariant  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.det_harness import MAX_TOKENS, alone, make_request, serve  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-gpu"), "qwen3", heads=16, kv_heads=8,
                           head_dim=128, layers=2, vocab=4096,
                           extra=dict(max_position_embeddings=4096))


@pytest.fixture(scope="module", autouse=True)
def _default_kernels_after():
    yield
    batch_invariant.enable(False)


def _worker(model_dir, **fields) -> Worker:
    opts = dict(model=str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
                max_num_seqs=128, max_batched_tokens=MAX_TOKENS, max_model_len=4096,
                deterministic=True)
    return Worker(WorkerOptions(**(opts | fields)))


def _messages(n: int, seed: int, longest: int = 300, max_tokens: int = 24):
    rng = random.Random(seed)
    return [make_request([rng.randrange(3, 4000) for _ in range(rng.randint(1, longest))],
                         rng.randint(1, max_tokens), rng.choice([0.0, 0.8]),
                         rng.choice([None, rng.randrange(1 << 30)])) for _ in range(n)]


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full", "none"])
def test_a_hundred_requests_at_once_give_what_each_gives_alone(model_dir, mode):
    worker = _worker(model_dir, cudagraph_mode=mode)
    messages = _messages(96, seed=1)
    got = serve(worker, [messages[:64], messages[64:]], max_running=128, max_batched_tokens=128)
    reference = _worker(model_dir) if mode != "full_and_piecewise" else worker
    for message, samples in list(zip(messages, got))[::4]:
        assert samples == alone(reference, message)


def test_long_contexts_split_over_programs_equal_their_prefill_and_alone(model_dir):
    """Prompts of 1,100-1,900 tokens (3-4 attention splits of 512), chunked by a 192-token
    step budget, decoded beside shorter requests."""
    worker = _worker(model_dir)
    messages = _messages(6, seed=2, longest=300) + [
        make_request([(7 * i + j) % 4000 + 3 for j in range(1100 + 200 * i)], 16, 0.8 * (i % 2), i)
        for i in range(5)]
    got = serve(worker, [messages], max_running=32, max_batched_tokens=192)
    for message, samples in zip(messages, got):
        assert samples == alone(worker, message)


def test_an_fp8_kv_cache_is_batch_invariant_too(model_dir):
    worker = _worker(model_dir, kv_cache_dtype="fp8")
    messages = _messages(40, seed=3)
    got = serve(worker, [messages], max_running=64, max_batched_tokens=96)
    for message, samples in list(zip(messages, got))[::3]:
        assert samples == alone(worker, message)


def test_the_deterministic_gemm_is_graph_capturable_and_stable_over_replays():
    from headrace.kernels import triton_invariant_gemm as gemm

    w = (torch.randn(4096, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    eager = gemm.linear(x, w)    # grows the split workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm.linear(x, w)
    for _ in range(20):
        graph.replay()
        assert torch.equal(out, eager)
