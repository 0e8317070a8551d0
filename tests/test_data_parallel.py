"""Two data-parallel engine cores behind API front ends, in the test process (tests.dp_harness):
prefix placement keeps a shared prefix on the core that caches it (hit rate >= 90% of one
core's on the same workload; round robin about half of it), a burst sharing a new prefix
follows its first request, equal cores share the work, a core lost mid-generation (its process,
or its data plane) hands its requests to the other with nothing lost, new requests avoid it,
a structured request resumed on the other core goes on under its grammar, and Admin reaches
both cores (a profile too: every core's files, apart, in one directory)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import grpc
import pytest

from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.controlplane.structured import backends
from headrace.v1 import inference_pb2 as pb
from tests.dp_harness import Cores, generate
from tests.harness import completion

BLOCK = 16


@pytest.fixture(scope="module")
def cores():
    c = Cores(2)
    yield c
    c.close()


def _workload(seed: int, tenants: int = 4, per_tenant: int = 3) -> list[list[int]]:
    """Tenant by tenant, each tenant's requests share a 4-block prefix (its own tokens) and
    end with 8 tokens of their own; ``seed`` keeps workloads apart (cold caches)."""
    prompts = []
    for t in range(tenants):
        prefix = [(seed * 997 + t * 131 + k * 7) % 2000 + 10 for k in range(4 * BLOCK)]
        prompts += [prefix + [(seed * 53 + t * 17 + r * 5 + k) % 2000 + 10 for k in range(8)]
                    for r in range(per_tenant)]
    return prompts


def _hit_rate(stub, prompts) -> float:
    cached = sum(generate(stub, p)[-1].usage.cached_prompt_tokens for p in prompts)
    return cached / sum(len(p) for p in prompts)


def test_prefix_placement_keeps_a_shared_prefix_where_it_is_cached(cores):
    single = _hit_rate(cores.frontend(cores=[0]), _workload(1))
    prefix = _hit_rate(cores.frontend("prefix"), _workload(2))
    round_robin = _hit_rate(cores.frontend("round-robin"), _workload(3))
    assert single > 0.5                                  # 2 of 3 requests of a tenant hit 64 of 72
    assert prefix >= 0.9 * single
    assert round_robin <= 0.6 * single                   # each tenant's prefix computed on both


def test_a_burst_sharing_a_new_prefix_follows_its_first_request(cores):
    stub = cores.frontend("prefix")
    prompts = _workload(4, tenants=1, per_tenant=8)
    before = [cores.prefix_hits(i) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: generate(stub, p, max_tokens=16), prompts))
    gained = [cores.prefix_hits(i) - before[i] for i in range(2)]
    assert sorted(gained)[0] == 0 and max(gained) > 0    # all on one core, whose cache served them


def test_equal_cores_share_requests_without_a_common_prefix(cores):
    stub = cores.frontend("prefix")
    before = [c.engine.scheduler.blocks.prefix_queries for c in cores.cores]
    for k in range(6):
        generate(stub, [(k * 37 + j) % 2000 + 10 for j in range(40)])
    assert all(c.engine.scheduler.blocks.prefix_queries > b for c, b in zip(cores.cores, before))


def _run(stub, prompt: str) -> tuple:
    """Each sample's (token ids, text, finish reason); every other prompt asks for two samples
    that stop at a stop string (a resumed request carries its unfinished samples by index)."""
    extra = dict(n=2, stop=[" the "]) if prompt.endswith(("1", "3", "5")) else {}
    responses = list(stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_tokens=48, ignore_eos=True, sampling=pb.SamplingParams(temperature=0),
        **extra), timeout=120))
    return tuple(completion([r for r in responses if r.index == i]) for i in range(extra.get("n", 1)))


def _generating(cores, tokens: int) -> int:
    """Requests in the cores that have generated ``tokens`` tokens or more."""
    return sum(len(r.sequences[0].output_token_ids) >= tokens
               for c in cores.cores for r in list(c.engine.requests.values()))


def _lose_mid_generation(cores, stub, lose, restore, run=_run, tokens: int = 0) -> list:
    prompts = [f"It is a truth universally acknowledged {i}" for i in range(8)]
    undisturbed = [run(stub, p) for p in prompts]
    if run is _run:
        assert any(sample[2] == pb.FINISH_REASON_STOP_STRING for run in undisturbed for sample in run)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, stub, p) for p in prompts]
        deadline = time.monotonic() + 30
        while _generating(cores, tokens) < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        busy = [len(c.engine.requests) for c in cores.cores]
        assert all(busy), f"both cores should be generating: {busy}"
        lose()
        assert not all(f.done() for f in futures), "the loss came too late to matter"
        disturbed = [f.result(timeout=120) for f in futures]
    assert disturbed == undisturbed                      # nothing lost, nothing sent twice
    assert all(run(stub, p) == u for p, u in zip(prompts[:2], undisturbed))   # new ones avoid it
    restore()
    return disturbed


def test_a_core_lost_mid_generation_hands_its_requests_over(cores):
    stub = cores.frontend("least-load")
    _lose_mid_generation(cores, stub, lambda: cores.stop_core(0), lambda: cores.start_core(0))


def test_a_core_whose_data_plane_is_lost_hands_its_requests_over(cores):
    stub = cores.frontend("least-load")
    _lose_mid_generation(cores, stub, lambda: cores.stop_worker(1), lambda: cores.start_worker(1))


NUMBERS = r"\[(\d{1,2}, ){12,16}\d{1,2}\]"


def _run_structured(stub, prompt: str) -> tuple:
    responses = list(stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_tokens=120, sampling=pb.SamplingParams(temperature=0),
        structured=pb.StructuredOutputs(regex=NUMBERS)), timeout=120))
    return completion(responses)


@pytest.mark.skipif(not any(backends.installed(n) for n in ("guidance", "xgrammar")),
                    reason="no grammar engine installed")
def test_a_structured_request_resumes_on_another_core_under_its_grammar(cores):
    """The new core's matcher consumes the tokens the request brings (Submit.resumed) before
    its first mask: the greedy output is the undisturbed one and still matches."""
    stub = cores.frontend("least-load")
    outputs = _lose_mid_generation(cores, stub, lambda: cores.stop_core(1), lambda: cores.start_core(1),
                                   run=_run_structured, tokens=4)
    for _, text, finish in outputs:
        assert finish == pb.FINISH_REASON_STOP and re.fullmatch(NUMBERS, text), text


def test_admin_reaches_every_core(cores):
    cores.frontend(admin_insecure_loopback=True)   # (Admin without a token: opted into)
    channel = grpc.insecure_channel(f"127.0.0.1:{cores.frontends[-1].port}")
    admin = apb_grpc.AdminStub(channel)
    config = admin.GetConfig(apb.GetConfigRequest(), timeout=10)
    assert len(config.workers) == 2 and config.num_kv_blocks == 2 * 256
    admin.UpdateConfig(apb.UpdateConfigRequest(max_running=7), timeout=10)
    assert [c.engine.scheduler.max_running for c in cores.cores] == [7, 7]
    drained = admin.Drain(apb.DrainRequest(timeout_s=1), timeout=10)
    assert drained.drained and all(c.engine.draining for c in cores.cores)
    admin.Resume(apb.ResumeRequest(), timeout=10)
    assert not any(c.engine.draining for c in cores.cores)
    admin.UpdateConfig(apb.UpdateConfigRequest(max_running=64), timeout=10)
    channel.close()


def test_a_profile_through_a_front_end_records_every_core(cores, tmp_path):
    stub = cores.frontend("round-robin", admin_insecure_loopback=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{cores.frontends[-1].port}")
    admin = apb_grpc.AdminStub(channel)
    started = admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=2), timeout=10)
    assert started.recording and started.num_steps == 2
    assert all(c.engine.profiler.recording is not None for c in cores.cores)
    for i in range(2):   # round robin: one request per core
        generate(stub, [300 + i] * 20, max_tokens=6)
    status = admin.StopProfile(apb.StopProfileRequest(wait_s=30), timeout=60)
    channel.close()
    assert not status.recording and status.steps_recorded == 2 * 2
    # (both cores share this process here: where cProfile refuses a second profiler, Python
    # 3.12, one core records no view of its own and says so; serve's cores are processes)
    assert len(status.errors) <= 1 and all(re.fullmatch(r"core [01]: engine core: cannot profile.*", e)
                                           for e in status.errors), status.errors
    names = sorted(os.path.basename(f) for f in status.files)
    for core in (0, 1):
        traces = [n for n in names if n.startswith("dataplane-rank0.") and n.endswith(f"-core{core}.pt.trace.json")]
        assert len(traces) == 1, names
    assert sum(n.startswith("core.") and n.endswith(".pstats") for n in names) == 2 - len(status.errors), names
    assert set(os.listdir(tmp_path)) == set(names)   # nothing overwritten
