"""Tensor parallelism on CPU (gloo; with HEADRACE_TEST_DEVICE=cuda, NCCL on as many GPUs as a case
has ranks): a control plane over N ``headrace dataplane --rank r`` processes generates exactly the
greedy (and seeded) tokens, and nearly the logprobs, of one unsharded worker, for KV heads split
across ranks and replicated (fewer KV heads than ranks), tied and untied embeddings, and a
vocabulary padded to a multiple of the world size."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from headrace.cli.main import _free_port
from headrace.dataplane.config import load_model_config
from headrace.dataplane.parallel import Shard
from tests.checkpoints import make_checkpoint
from tests.harness import DEVICE, Planes, completion
from headrace.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow   # rank processes (each imports torch)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], list(range(20, 60, 3))]

# name -> (family, checkpoint options, world size)
CASES = {
    "llama-h8-kv2-tp2": ("llama", dict(heads=8, kv_heads=2), 2),
    "llama-h4-kv2-tp4-kv-replicated": ("llama", dict(heads=4, kv_heads=2), 4),
    "qwen3-h4-kv2-tp4-tied-padded-vocab": ("qwen3", dict(heads=4, kv_heads=2, tie=True, vocab=390), 4),
    "qwen3-h8-kv2-tp2": ("qwen3", dict(heads=8, kv_heads=2), 2),
}


@contextlib.contextmanager
def _ranks(model: pathlib.Path, world: int, extra: tuple[str, ...] = ()):
    """``world`` data plane rank processes over ``model``: yields (processes, addresses); kills
    them (nothing here depends on a graceful stop, which a rank may spend in its process
    group's teardown) and removes their directory afterwards."""
    # the ranks' logs (and sockets) go to HEADRACE_TP_LOG_DIR when set: kept for a device run;
    # else a short directory of their own (a unix socket path must stay under 108 bytes)
    keep = os.environ.get("HEADRACE_TP_LOG_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="headrace-tp-", dir=keep or None)
    procs: list[subprocess.Popen] = []
    try:
        yield _start_ranks(model, world, extra, tmp, procs)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _start_ranks(model: pathlib.Path, world: int, extra: tuple[str, ...], tmp: str,
                 procs: list[subprocess.Popen]) -> tuple[list[subprocess.Popen], list[str]]:
    dist_init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    addresses = []
    for r in range(world):
        address = f"unix:{tmp}/dp-{r}.sock"
        argv = [sys.executable, "-P", "-m", "headrace.cli", "dataplane", "--model", str(model),
                "--listen", address, "--rank", str(r), "--world-size", str(world),
                "--dist-init", dist_init, "--dist-timeout", "180",
                *(() if "--num-kv-blocks" in extra else ("--num-kv-blocks", "64")),
                "--max-num-seqs", "16", "--max-batched-tokens", "256", "--metrics-port", "0",
                "--dtype", "float32", "--log-format", "json",
                "--device", DEVICE, *extra]   # cuda: rank r on GPU r, NCCL
        with open(f"{tmp}/rank-{r}.log", "wb") as log:   # the ranks' logs, for debugging
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log))
        addresses.append(address)
    return procs, addresses


def _generate_all(planes: Planes) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations of PROMPTS, plus a seeded sampled one of the first prompt (its
    noise depends only on the seed, so TP and one worker draw the same tokens)."""
    def run(i):
        sampling = (pb.SamplingParams(temperature=0) if i < len(PROMPTS)
                    else pb.SamplingParams(temperature=0.9, top_k=50, seed=1234))
        responses = planes.generate(prompt_token_ids=pb.TokenIds(ids=PROMPTS[i % len(PROMPTS)]),
                                    max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, sampling=sampling)
        ids, _, reason = completion(responses)
        assert reason == pb.FINISH_REASON_LENGTH
        return ids, [lp.logprob for r in responses for lp in r.logprobs]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        return list(pool.map(run, range(len(PROMPTS) + 1)))


def _reload(addresses: list[str], model: pathlib.Path) -> None:
    """Every rank loads ``model`` (together: the ranks of a group load their shards at once)."""
    import grpc

    from headrace.worker.v1 import worker_pb2 as wpb
    from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc

    def one(address):
        with grpc.insecure_channel(address) as channel:
            return wpb_grpc.WorkerStub(channel).Reload(wpb.ReloadRequest(model=str(model)), timeout=180)

    with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
        assert {i.model_name for i in pool.map(one, addresses)} == {load_model_config(model).name}


@pytest.fixture(scope="module")
def rank_groups():
    """Rank processes kept for the module, one group per world size; each case after the
    first reloads its checkpoint into them (Reload) instead of starting its own ranks (each
    start imports torch: seconds of CPU per rank)."""
    groups, stack = {}, contextlib.ExitStack()

    def get(world: int, model: pathlib.Path) -> list[str]:
        if world in groups:
            _reload(groups[world], model)
        else:
            groups[world] = stack.enter_context(_ranks(model, world))[1]
        return groups[world]

    with stack:
        yield get


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_greedy_matches_single_worker(case, tmp_path, rank_groups):
    family, opts, world = CASES[case]
    if DEVICE == "cuda":
        import torch
        if torch.cuda.device_count() < world:
            pytest.skip(f"{world} GPUs needed")
    model = make_checkpoint(tmp_path / "ckpt", family, head_dim=32, **opts)
    addresses = rank_groups(world, model)
    single = Planes(model, num_kv_blocks=64)
    try:
        expected = _generate_all(single)
    finally:
        single.close()
    planes = Planes(model, workers=addresses)
    try:
        infos = planes.call(_describe(planes))
        assert [i.rank for i in infos] == list(range(world))
        assert {i.world_size for i in infos} == {world}
        got = _generate_all(planes)
    finally:
        planes.close()
    for (ids, lps), (ref_ids, ref_lps) in zip(got, expected):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=1e-3)


def test_tp_ranks_each_offload_their_shard_to_the_host_tier(tmp_path):
    """Two ranks with a host KV tier and a 6-block device pool: every rank gets the same
    block copies and keeps its own KV heads; greedy tokens equal one roomy worker's through
    device evictions, host hits and swap preemptions."""
    from headrace.controlplane.engine.loop import EngineConfig

    if DEVICE == "cuda":
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip("2 GPUs needed")
    model = make_checkpoint(tmp_path / "ckpt", "qwen3", head_dim=32, heads=8, kv_heads=2)
    prompts = [list(range(30, 70)), [200 + i for i in range(40)], list(range(30, 70)) + [5, 6],
               [100 + 2 * i for i in range(36)]]

    def run(planes, prompt):
        return completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=NEW_TOKENS,
                                          ignore_eos=True, sampling=pb.SamplingParams(temperature=0)))[0]

    with _ranks(model, 2, ("--num-kv-blocks", "6", "--kv-offloading-size", "0.001")) as (procs, addresses):
        single = Planes(model, num_kv_blocks=64)
        try:
            expected = [run(single, p) for p in prompts]
        finally:
            single.close()
        planes = Planes(model, workers=addresses,   # host hits loaded whatever the cost rule says
                        config=EngineConfig(preemption_mode="swap", kv_offloading_policy="always"))
        try:
            sequential = [run(planes, p) for p in prompts]     # evicted, then found on the host
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:   # preempted
                concurrent_ = list(pool.map(lambda p: run(planes, p), prompts))
            blocks = planes.engine.scheduler.blocks
            assert blocks.host is not None and blocks.host.hits > 0 and blocks.host.blocks_out > 0
        finally:
            planes.close()
        assert sequential == expected and concurrent_ == expected


def test_dead_rank_makes_group_unhealthy(tmp_path):
    """Killing rank 1 mid-service breaks its step stream: the control plane marks the group
    unhealthy (and rank 0, left in a collective, fails the step instead of hanging)."""
    model = make_checkpoint(tmp_path / "ckpt", "llama", heads=4, kv_heads=2, head_dim=32, layers=1)
    with _ranks(model, 2) as (procs, addresses):
        planes = Planes(model, workers=addresses)
        try:
            assert _generate_all(planes)
            assert planes.engine.healthy
            procs[1].kill()
            pool = concurrent.futures.ThreadPoolExecutor(1)
            pool.submit(lambda: list(planes.stub.Generate(pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]), max_tokens=NEW_TOKENS), timeout=30)))
            deadline = time.monotonic() + 30
            while planes.engine.healthy and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not planes.engine.healthy
            pool.shutdown(wait=False, cancel_futures=True)
        finally:
            planes.close()


async def _describe(planes: Planes):
    return planes.plane.engine.workers.infos


def test_shard_arithmetic(tmp_path):
    cfg = load_model_config(make_checkpoint(tmp_path / "c", "llama", heads=4, kv_heads=2,
                                            head_dim=32, layers=1, vocab=390))
    shards = [Shard.of(cfg, r, 4) for r in range(4)]
    assert [s.num_heads for s in shards] == [1, 1, 1, 1]
    assert [(s.num_kv_heads, s.kv_head_start) for s in shards] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [s.vocab_per_rank for s in shards] == [98] * 4
    assert [s.vocab_rows for s in shards] == [98, 98, 98, 96]
    two = [Shard.of(cfg, r, 2) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in two] == [(2, 1, 0), (2, 1, 1)]
    with pytest.raises(ValueError):
        Shard.of(cfg, 0, 3)
