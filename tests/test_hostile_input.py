"""Hostile input against the public API: random requests (hypothesis), random bytes at the
port, and a storm of streams cancelled at random points. The server must answer every bad
request with INVALID_ARGUMENT (never INTERNAL or UNKNOWN), keep serving, and leak no KV
blocks."""

from __future__ import annotations

import concurrent.futures
import random
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import completion
from headrace.v1 import inference_pb2 as pb

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.just(0.0))
sampling = st.builds(
    lambda t, p, k, m, r, pr, fr, seed: pb.SamplingParams(
        **{k_: v for k_, v in dict(temperature=t, top_p=p, repetition_penalty=r, seed=seed).items()
           if v is not None}, top_k=k, min_p=m, presence_penalty=pr, frequency_penalty=fr),
    st.one_of(st.none(), floats), st.one_of(st.none(), floats), st.integers(-2**31, 2**31 - 1),
    floats, st.one_of(st.none(), floats), floats, floats, st.one_of(st.none(), st.integers(0, 2**64 - 1)))
requests = st.builds(
    lambda prompt, ids, use_ids, s, mt, mn, stop, stop_ids, lp, n, rid: pb.GenerateRequest(
        request_id=rid, sampling=s, min_tokens=mn, stop=stop, stop_token_ids=stop_ids,
        logprobs=lp, n=n, ignore_eos=True,
        **({"prompt_token_ids": pb.TokenIds(ids=ids)} if use_ids else {"prompt": prompt}),
        **({} if mt is None else {"max_tokens": mt})),
    st.text(max_size=200), st.lists(st.integers(0, 2**32 - 1), max_size=40), st.booleans(), sampling,
    st.one_of(st.none(), st.integers(-2**31, 8)), st.integers(-2**31, 2**31 - 1),
    st.lists(st.text(max_size=8), max_size=4), st.lists(st.integers(0, 2**32 - 1), max_size=4),
    st.integers(-2**31, 2**31 - 1), st.integers(0, 2**32 - 1), st.text(max_size=20))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_random_requests_get_a_clear_status_or_a_completion(llama_planes, req):
    try:
        responses = list(llama_planes.stub.Generate(req, timeout=30))
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details(), req)
        assert exc.details()
        return
    # accepted: it must have finished properly, every sample
    finals = [r for r in responses if r.finish_reason]
    assert len(finals) == max(1, req.n)


def test_server_survives_random_bytes_and_leaks_nothing(llama_planes):
    start_free = llama_planes.free_blocks
    host, port = llama_planes.address.rsplit(":", 1)
    rng = random.Random(0)
    for i in range(30):
        with socket.create_connection((host, int(port)), timeout=2) as sock:
            if i % 3 == 0:   # an HTTP/2 preface, then garbage frames
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096))))
    ok = llama_planes.generate(prompt="hello", max_tokens=3, ignore_eos=True)
    assert completion(ok)[2] == pb.FINISH_REASON_LENGTH
    assert llama_planes.wait_for_free_blocks(start_free) == start_free


def _rss_bytes() -> int:
    """Resident memory of this process (both planes run in it here)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow   # 1,200 streams
@pytest.mark.timeout(240)
def test_streams_cancelled_at_random_points_leak_no_blocks(llama_planes):
    start_free = llama_planes.free_blocks
    rng = random.Random(1)
    plan = [(rng.randrange(1, 60), rng.randrange(0, 6)) for _ in range(1200)]

    def one(job):
        prompt_len, cancel_after = job
        call = llama_planes.stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=[7] * prompt_len), max_tokens=40, ignore_eos=True))
        try:
            for i, _ in enumerate(call):
                if i >= cancel_after:
                    break
        finally:
            call.cancel()

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(one, plan[:200]))          # warm-up: allocator pools, thread stacks
        llama_planes.wait_for_free_blocks(start_free, timeout=30)
        rss_before = _rss_bytes()
        list(pool.map(one, plan[200:]))
    assert llama_planes.wait_for_free_blocks(start_free, timeout=30) == start_free
    growth = _rss_bytes() - rss_before
    assert growth < 64 << 20, f"memory grew by {growth >> 20} MiB over {len(plan) - 200} cancelled streams"
    assert not llama_planes.engine.requests
    assert not llama_planes.engine.scheduler.running and not llama_planes.engine.scheduler.waiting
    ok = llama_planes.generate(prompt="hello", max_tokens=3, ignore_eos=True)
    assert completion(ok)[2] == pb.FINISH_REASON_LENGTH
    assert time.monotonic() - t0 < 200


def test_absurd_sizes_are_rejected_before_any_work(llama_planes):
    start_free = llama_planes.free_blocks
    absurd = [
        dict(prompt_token_ids=pb.TokenIds(ids=[5] * 10_000_000)),          # 10M-token prompt
        dict(prompt="the " * 2_500_000),                                   # 10M characters
        dict(prompt="hi", stop=["x"] * 10_000),
        dict(prompt="hi", max_tokens=2**31 - 1),
        dict(prompt="hi", n=2**31),
    ]
    for fields in absurd:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            llama_planes.generate(**fields)
        assert info.value.code() in ALLOWED, info.value.details()
        assert time.monotonic() - t0 < 10
    with pytest.raises(grpc.RpcError) as info:   # beyond the largest valid request: the transport refuses
        llama_planes.stub.Tokenize(pb.TokenizeRequest(text="the " * 2_500_000))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:   # beyond what max_model_len can take: refused untokenized
        llama_planes.stub.Tokenize(pb.TokenizeRequest(text="t" * (llama_planes.plane.requests.max_text_bytes + 1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert llama_planes.wait_for_free_blocks(start_free) == start_free
    ok = llama_planes.generate(prompt="hello", max_tokens=2, ignore_eos=True)
    assert completion(ok)[2] == pb.FINISH_REASON_LENGTH
