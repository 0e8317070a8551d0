"""The host KV tier end to end on CPU (headrace.dataplane.kv_offload's copy engine under the control
plane's host tier): greedy outputs equal with offloading on and off under a KV pool small
enough to evict and preempt, whether the cost rule loads host hits, recomputes them or
decides (--kv-offloading-policy); a prompt evicted from the device is found on the host
(counted as cached, not recomputed) or, by policy never, recomputed and counted so; swap
preemption resumes from the host; a restarted data plane's host tier is forgotten; and the
copy engine itself (block contents, bad input, its measured load rate)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.kv.tier_cost import prefill_slope
from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.kv_offload import HostKV, host_blocks_for
from tests.checkpoints import make_checkpoint
from tests.harness import DEVICE, Planes, completion
from tests.test_scheduling_e2e import _workload
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0)
OFFLOAD = {"kv_offloading_size": 0.002}   # GiB: 128 host blocks of the tiny model's 16 KiB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", heads=4, kv_heads=2, head_dim=32)


def _gen(planes, prompt, n):
    out = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n, ignore_eos=True,
                          sampling=GREEDY)
    return completion(out)[0], out[-1].usage.cached_prompt_tokens


def _run_all(planes, jobs):
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: _gen(planes, *j)[0], jobs))


@pytest.fixture(scope="module")
def expected(model_dir):
    roomy = Planes(model_dir, num_kv_blocks=512,
                   config=EngineConfig(max_batched_tokens=4096, enable_prefix_cache=False))
    try:
        return _run_all(roomy, _workload())
    finally:
        roomy.close()


@pytest.mark.parametrize("mode,policy", [("recompute", "always"), ("swap", "auto"),
                                         ("recompute", "never")])
def test_outputs_equal_with_offloading_under_eviction_and_preemption(model_dir, expected, mode, policy):
    tight = Planes(model_dir, num_kv_blocks=8, worker_fields=OFFLOAD,
                   config=EngineConfig(max_batched_tokens=24, preemption_mode=mode,
                                       kv_offloading_policy=policy))
    try:
        got = _run_all(tight, _workload())
        sched = tight.engine.scheduler
        host = sched.blocks.host
        assert host is not None and host.num_blocks == tight.engine.info.num_host_kv_blocks > 0
        assert sched.num_preemptions > 0 and host.blocks_out > 0
        if mode == "swap":
            assert host.blocks_in > 0
        if policy == "never":   # host hits were found, and every one recomputed
            assert host.hits == 0 and sched.tier_cost.skipped_tokens > 0
        assert tight.wait_for_free_blocks(8) == 8
        assert not host.swapped and not any(host.ref)
    finally:
        tight.close()
    assert got == expected


@pytest.mark.parametrize("policy", ["always", "never", "auto", "auto, a dear copy"])
def test_a_prompt_evicted_from_the_device_is_found_on_the_host(model_dir, policy):
    """``auto`` on a CPU: copying a block costs well under a microsecond per token, computing
    one a hundred or more: it loads; made dear, it recomputes."""
    prompt = list(range(2, 66))    # 64 tokens: 3 full blocks are reusable (the last is computed)
    others = [[300 - i] * 40 for i in range(3)]
    ref = Planes(model_dir, num_kv_blocks=64)
    try:
        want = _gen(ref, prompt, 4)[0]
    finally:
        ref.close()
    planes = Planes(model_dir, num_kv_blocks=8, worker_fields=OFFLOAD,
                    config=EngineConfig(kv_offloading_policy=policy.split(",")[0]),
                    plane_options={"admin_insecure_loopback": True})
    try:
        assert planes.stub.GetModelInfo(pb.GetModelInfoRequest()).num_host_kv_blocks > 0
        first, cached = _gen(planes, prompt, 4)
        assert first == want and cached == 0
        for other in others:      # 3 x 3 blocks: the prompt's blocks are evicted
            _gen(planes, other, 4)
        blocks = planes.engine.scheduler.blocks
        hits = blocks.match_prefix(prompt)   # host hits are ~host block (negative)
        on_host = sum(1 for b in hits if b < 0)
        assert len(hits) == 3 and on_host >= 2
        hits_before = blocks.host.hits
        rule = planes.engine.scheduler.tier_cost
        info = planes.worker.describe()   # the worker's own measurements price both sides
        assert list(info.prefill_profile_tokens) == [32, 128]   # up to the pool's 8 blocks
        assert all(s > 0 for s in info.prefill_profile_seconds)
        assert rule.recompute_s_per_token == pytest.approx(
            prefill_slope(info.prefill_profile_tokens, info.prefill_profile_seconds))
        if policy == "auto, a dear copy":   # (a loaded CPU may time no rising profile)
            rule.load_s_per_block, rule.recompute_s_per_token = 1e3, rule.recompute_s_per_token or 1e-5
        again, cached = _gen(planes, prompt, 4)
        assert again == want
        sample = planes.plane.metrics.registry.get_sample_value
        admin = apb_grpc.AdminStub(planes.channel).GetConfig(apb.GetConfigRequest())
        assert admin.kv_offloading_policy == policy.split(",")[0]
        assert admin.host_load_seconds_per_token == pytest.approx(rule.load_s_per_token)
        assert admin.host_load_seconds_per_token > 0
        assert admin.recompute_seconds_per_token == pytest.approx(rule.recompute_s_per_token or 0.0)
        assert sample("headrace:kv_tier_seconds_per_token", {"action": "recompute"}) == \
            pytest.approx(rule.recompute_s_per_token or 0.0)
        skipped = sample("headrace:kv_tier_host_hits_recomputed_total")
        assert skipped == admin.host_hits_recomputed_tokens == rule.skipped_tokens
        assert sample("headrace:kv_tier_seconds_per_token", {"action": "load"}) == \
            pytest.approx(admin.host_load_seconds_per_token)
        if policy != "always" and policy != "auto":   # recomputed: the device tier's hits only,
            # the host copies kept
            assert cached == 48 - 16 * on_host and blocks.host.hits == hits_before
            assert skipped == 16 * on_host
            for b in (~b for b in hits if b < 0):   # still cached on the host where they were
                assert blocks.host.lookup(*blocks.host.entry(b)) == b
            return
        assert cached == 48 and blocks.host.hits - hits_before == 16 * on_host   # not recomputed
        assert skipped == 0
        assert sample("headrace:kv_tier_prefix_hits_total", {"tier": "host"}) == blocks.host.hits
        assert sample("headrace:kv_tier_blocks", {"tier": "host"}) == blocks.host.num_blocks
        assert sample("headrace:kv_offload_blocks_total", {"direction": "in"}) >= on_host
        assert sample("headrace:kv_offload_bytes_total", {"direction": "in"}) > 0   # the data plane's
        admin = apb_grpc.AdminStub(planes.channel).GetConfig(apb.GetConfigRequest())
        assert admin.num_host_kv_blocks == blocks.host.num_blocks and admin.preemption_mode == "recompute"
    finally:
        planes.close()


def test_policy_off_leaves_the_workers_host_tier_unused(model_dir):
    """One data plane compared with and without its tier: only the control plane changes."""
    prompt = list(range(2, 66))
    planes = Planes(model_dir, num_kv_blocks=8, worker_fields=OFFLOAD,
                    config=EngineConfig(kv_offloading_policy="off"),
                    plane_options={"admin_insecure_loopback": True})
    try:
        assert planes.worker.runner.host_kv is not None and planes.engine.scheduler.blocks.host is None
        want, _ = _gen(planes, prompt, 4)
        for i in range(3):
            _gen(planes, [300 - i] * 40, 4)
        again, cached = _gen(planes, prompt, 4)
        assert again == want and cached < 48   # evicted blocks are kept nowhere: recomputed
        admin = apb_grpc.AdminStub(planes.channel).GetConfig(apb.GetConfigRequest())
        assert admin.kv_offloading_policy == "off" and admin.num_host_kv_blocks == 0
        assert planes.worker.runner.host_kv.drain()[1:] == (0, 0)   # not a byte copied
    finally:
        planes.close()


def test_a_restarted_data_plane_forgets_its_host_tier(model_dir):
    from headrace.dataplane.server import serve
    from headrace.dataplane.worker import Worker, WorkerOptions

    prompt = list(range(2, 66))
    planes = Planes(model_dir, num_kv_blocks=8, worker_fields=OFFLOAD,
                    config=EngineConfig(reconnect_interval_s=0.1))
    try:
        want, _ = _gen(planes, prompt, 4)
        for i in range(3):
            _gen(planes, [300 - i] * 40, 4)
        assert planes.engine.scheduler.blocks.host.cached
        planes.worker_server.stop(0).wait()
        planes.worker = Worker(WorkerOptions(model=str(model_dir), num_kv_blocks=8, block_size=16,
                                             dtype="float32", max_num_seqs=64, **OFFLOAD))
        planes.worker_server = serve(planes.worker, planes.worker_address)
        # the old stream ended: the engine reset (both tiers forgotten) and reconnects; on a
        # busy machine it may still be reconnecting, when new requests are refused
        # (UNAVAILABLE): wait for it first
        deadline = time.monotonic() + 120
        while not planes.engine.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        again, cached = _gen(planes, prompt, 4)
        assert again == want and cached == 0     # admitted again without the lost host blocks
        assert planes.engine.healthy
    finally:
        planes.close()


# -- the copy engine -------------------------------------------------------------------------
def _caches(layers=2, blocks=6, dtype=torch.float32):
    return [torch.randn(2, blocks, 4, 2, 8).to(dtype).to(DEVICE) for _ in range(layers)]


def _sync():
    if DEVICE.startswith("cuda"):   # the copies run on a side stream the current one waits for
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_go_to_the_host_and_come_back_into_other_blocks(dtype):
    caches = _caches(dtype=dtype)
    before = [c.clone() for c in caches]
    host = HostKV(caches, 4, torch.device(DEVICE))
    host.apply(caches, [1, 4], [3, 0], [], [])
    for c in caches:
        c[:, 1] = 0   # the device blocks are reused
    host.apply(caches, [], [], [0, 3], [2, 5])
    _sync()
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 2].view(torch.uint8), b[:, 4].view(torch.uint8))
        assert torch.equal(c[:, 5].view(torch.uint8), b[:, 1].view(torch.uint8))
    ms, out, into = host.drain()
    assert out == into == 2 * host.block_bytes and ms >= 0 and host.drain()[1:] == (0, 0)


def test_a_swap_out_runs_before_the_copies_and_the_swap_in_of_its_step():
    caches = _caches()
    saved = [c[:, 0].clone() for c in caches]
    host = HostKV(caches, 2, torch.device(DEVICE))
    # block 0 is saved to host 1, block 3 overwrites it (a copy), then host 1 comes back to 2
    host.apply(caches, [0], [1], [1], [2], between=lambda: [c[:, 0].copy_(c[:, 3]) for c in caches])
    _sync()
    for c, s in zip(caches, saved):
        assert torch.equal(c[:, 2], s) and torch.equal(c[:, 0], c[:, 3])


def test_the_load_rate_is_measured_on_the_pool():
    caches = _caches()
    host = HostKV(caches, 4, torch.device(DEVICE))
    rate = host.measure_load_rate(caches)
    assert 0 < rate < float("inf")
    assert 4 * host.block_bytes / rate < 1.0   # bytes per second: four tiny blocks, well under 1 s


def test_bad_copies_and_sizes_are_refused():
    host = HostKV(_caches(), 4, torch.device(DEVICE))
    with pytest.raises(BatchError, match="length"):
        host.check([1], [], [], [])
    with pytest.raises(BatchError, match="out of range"):
        host.check([6], [0], [], [])
    with pytest.raises(BatchError, match="out of range"):
        host.check([], [], [4], [0])
    with pytest.raises(ValueError, match="kv-offloading-size"):
        host_blocks_for(-1, 1024)
    with pytest.raises(ValueError, match="host memory"):
        host_blocks_for(1 << 20, 1024)
    assert host_blocks_for(0, 1024) == 0 and host_blocks_for(1 / 1024, 1024) == 1024


def test_consecutive_host_blocks_move_in_one_copy():
    from headrace.dataplane.kv_offload import runs

    assert runs([]) == [] and runs([4]) == [(0, 4, 1)]
    assert runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    caches = _caches(blocks=8)
    before = [c.clone() for c in caches]
    host = HostKV(caches, 8, torch.device(DEVICE))
    host.apply(caches, [0, 1, 2, 5], [4, 5, 6, 1], [], [])       # runs 4-6 and 1
    host.apply(caches, [], [], [5, 6, 1, 4], [7, 3, 0, 2])
    _sync()
    for c, b in zip(caches, before):
        for dev, src in ((7, 1), (3, 2), (0, 5), (2, 0)):
            assert torch.equal(c[:, dev], b[:, src])


def test_measuring_the_load_rate_leaves_the_cache_zeroed():
    caches = [torch.zeros(2, 6, 4, 2, 8, device=DEVICE) for _ in range(2)]
    host = HostKV(caches, 4, torch.device(DEVICE))
    host.pool.fill_(float("nan"))   # what an uninitialised pool may hold
    host.measure_load_rate(caches)
    _sync()
    assert all(not c.isnan().any() and not c.any() for c in caches)
