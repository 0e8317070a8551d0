"""The engine core and an API front end as ``headrace serve`` runs them, here in one event loop
(tests.harness ``split=True``): every kind of request answers exactly as the control plane in
one piece does (tokens, text, stop strings, logprobs, n samples, usage), one trace spans the
front end and the core, and the core refuses what only it can know (a request id in use on
another front end)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from headrace.common import tracing
from headrace.controlplane.frontend.server import FrontEnd
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.harness import Planes

MODEL = str(default_model_dir())
REQUESTS = {
    "greedy": dict(prompt="The river", max_tokens=20, sampling=pb.SamplingParams(temperature=0)),
    "stop string": dict(prompt="Once upon a time", max_tokens=40, stop=[" the"],
                        sampling=pb.SamplingParams(temperature=0)),
    "n=3 seeded, logprobs": dict(prompt="A small boat", max_tokens=12, n=3, logprobs=2,
                                 sampling=pb.SamplingParams(temperature=0.9, seed=7)),
    "n=2 stop strings": dict(prompt="In the morning", max_tokens=30, n=2, stop=["e", "a"],
                             sampling=pb.SamplingParams(temperature=0.8, seed=3)),
    "interval 5": dict(prompt="Water runs", max_tokens=17, stream_interval=5,
                       sampling=pb.SamplingParams(temperature=0)),
}


@pytest.fixture(scope="module")
def pair():
    whole = Planes(MODEL)
    split = Planes(MODEL, split=True, plane_options={"http_port": 0, "admin_insecure_loopback": True})
    yield whole, split
    whole.close()
    split.close()


def _answer(planes: Planes, name: str) -> list[pb.GenerateResponse]:
    responses = planes.generate(request_id=f"r-{name}", **REQUESTS[name])
    for r in responses:
        r.ClearField("request_id")
    return responses


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_split_answers_exactly_as_one_process(pair, name):
    whole, split = pair
    expected, got = _answer(whole, name), _answer(split, name)
    assert [r.finish_reason for r in got if r.finish_reason]   # every sample finished
    assert got == expected
    assert split.wait_for_free_blocks(split.engine.scheduler.blocks.num_blocks) == \
        split.engine.scheduler.blocks.num_blocks


def test_split_stops_on_a_stop_token_as_one_process(pair):
    whole, split = pair
    ids = [t for r in _answer(whole, "greedy") for t in r.token_ids]
    REQUESTS["stop token"] = dict(REQUESTS["greedy"], stop_token_ids=[ids[6]])
    expected, got = _answer(whole, "stop token"), _answer(split, "stop token")
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP and got == expected


def test_http_streams_through_the_front_end(pair):
    _, split = pair
    expected = "".join(r.text for r in _answer(split, "greedy"))
    body = {"prompt": "The river", "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{split.plane.http.port}/v1/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(c["text"] for chunk in chunks[:-1] for c in json.loads(chunk)["choices"])
    assert text == expected


def test_a_request_id_in_use_on_another_front_end_is_refused_by_the_core(pair):
    _, split = pair

    async def second_front_end():
        frontend = FrontEnd(1, split.core.address, MODEL, "127.0.0.1:0", reuse_port=False)
        await frontend.start()
        while not frontend.client.ready:
            await asyncio.sleep(0.01)
        return frontend

    other = split.call(second_front_end())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{other.port}") as channel:
            long = split.stub.Generate(pb.GenerateRequest(
                request_id="shared", prompt="The river", max_tokens=400, ignore_eos=True), timeout=60)
            next(long)
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                    request_id="shared", prompt="Water", max_tokens=4), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "already in use" in err.value.details()
            long.cancel()
    finally:
        split.call(other.stop(grace=0))


def test_one_trace_spans_the_front_end_and_the_core():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable_tracing(provider)
    try:
        planes = Planes(MODEL, split=True)
    finally:
        tracing.disable_tracing()
    try:
        trace_id, span_id = random.Random(5).getrandbits(128), random.Random(6).getrandbits(64)
        header = f"00-{trace_id:032x}-{span_id:016x}-01"
        responses = list(planes.stub.Generate(pb.GenerateRequest(
            prompt="The river", max_tokens=4, sampling=pb.SamplingParams(temperature=0)),
            metadata=[("traceparent", header)], timeout=60))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        planes.wait_for_free_blocks(planes.engine.scheduler.blocks.num_blocks)
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        by_name = {s.name: s for s in spans}
        server, core = by_name["/headrace.v1.Inference/Generate"], by_name["headrace.core.request"]
        assert server.parent.span_id == span_id          # the caller's span
        assert core.parent.span_id == server.context.span_id   # across the core stream
        for name in ("headrace.queue", "headrace.prefill", "headrace.decode"):
            assert by_name[name].parent.span_id == core.context.span_id, name
        assert "headrace.dataplane.step" in by_name     # and on into the data plane
    finally:
        planes.close()


def test_front_end_learns_limits_changed_through_admin(pair):
    from headrace.v1 import admin_pb2 as apb
    from headrace.v1 import admin_pb2_grpc as apb_grpc

    _, split = pair
    admin = apb_grpc.AdminStub(split.channel)
    before = admin.GetConfig(apb.GetConfigRequest(), timeout=10).max_queued
    try:
        assert admin.UpdateConfig(apb.UpdateConfigRequest(max_queued=3), timeout=10).max_queued == 3
        deadline = time.monotonic() + 5
        while split.plane.client.max_queued != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert split.plane.client.max_queued == 3
    finally:
        admin.UpdateConfig(apb.UpdateConfigRequest(max_queued=before), timeout=10)


def test_client_latencies_are_the_front_ends_only(pair):
    """TTFT, ITL and e2e are observed once, by the front end as it streams to its client; the
    core observes the engine's own histograms (queue, prefill, decode) and none of those."""
    _, split = pair
    front, core = split.plane.metrics.registry, split.core.plane.metrics.registry

    def counts(registry):
        return {name: registry.get_sample_value(f"headrace:{name}_count") or 0.0
                for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                             "e2e_request_latency_seconds", "request_queue_time_seconds",
                             "request_decode_time_seconds")}

    before_front, before_core = counts(front), counts(core)
    responses = split.generate(prompt="The river", max_tokens=9, ignore_eos=True,
                               sampling=pb.SamplingParams(temperature=0))
    first = next(r for r in responses if r.token_ids)
    split.wait_for_free_blocks(split.engine.scheduler.blocks.num_blocks)
    front_d = {k: v - before_front[k] for k, v in counts(front).items()}
    core_d = {k: v - before_core[k] for k, v in counts(core).items()}
    assert front_d["time_to_first_token_seconds"] == front_d["e2e_request_latency_seconds"] == 1
    assert front_d["inter_token_latency_seconds"] == 9 - len(first.token_ids)
    assert core_d["time_to_first_token_seconds"] == core_d["inter_token_latency_seconds"] == 0
    assert core_d["e2e_request_latency_seconds"] == 0
    assert core_d["request_queue_time_seconds"] == core_d["request_decode_time_seconds"] == 1
    assert front_d["request_queue_time_seconds"] == 0


def test_the_core_dates_a_request_by_its_age_on_its_own_clock(pair):
    """A Submit carries how long ago the request reached its front end, not the front end's
    clock (which may be another host's): the core's queue time starts that long before."""
    from headrace.core.v1 import core_pb2 as cpb
    from headrace.core.v1 import core_pb2_grpc as cpb_grpc
    from headrace.worker.v1 import worker_pb2 as wpb

    _, split = pair
    registry = split.core.plane.metrics.registry
    queued = lambda: registry.get_sample_value("headrace:request_queue_time_seconds_sum")  # noqa: E731
    before = queued()
    submit = cpb.Submit(handle=1, request_id="aged", prompt_token_ids=[5, 6, 7], max_tokens=2,
                        sampling=[wpb.Sampling(temperature=0)], age=30.0)
    held = threading.Event()

    def ups():   # the stream stays open (its end would abort the request) until the answer
        yield cpb.Up(hello=cpb.Hello(frontend_index=7), submits=[submit])
        held.wait(30)

    finish = None
    with grpc.insecure_channel(split.core_address) as channel:
        downs = cpb_grpc.EngineCoreStub(channel).Connect(ups(), timeout=30)
        try:
            for down in downs:
                finish = next((d.finish_reason for d in down.deltas if d.finish_reason), None)
                if finish:
                    break
        finally:
            held.set()
            downs.cancel()
    assert finish == pb.FINISH_REASON_LENGTH
    assert 30.0 <= queued() - before < 40.0


def test_a_folded_steps_tokens_go_out_before_the_next_step(pair, monkeypatch):
    """With other steps in flight (the device busy), the core hands the front ends' news of a
    folded step to their links (``Engine.flush_woken``) before it schedules and sends the next
    one, and the token does reach the front end. (When the stream task reads the link is up to
    the event loop: it may still be writing the previous message, so that is not asserted.)"""
    _, split = pair
    engine, events = split.engine, []
    send, fold, flush = engine.workers.send, engine._fold, engine.flush_woken

    def recording_flush():
        events.append("flush")
        flush()

    async def recording_send(msg):
        events.append("send")
        await send(msg)

    def recording_fold(step, result):
        emitted = fold(step, result)
        events.append(f"fold {emitted}")
        return emitted

    # the split's own front end (index 0): earlier tests' links (a second front end, a raw
    # stream) may still be in the set while the core notices that they ended
    link = next(link for link in split.core.service.links if link.index == 0)
    next_message = link.next_message

    async def recording_next_message():
        msg = await next_message()
        if msg.token_handles or msg.deltas:
            events.append("down")
        return msg

    monkeypatch.setattr(engine.workers, "send", recording_send)
    monkeypatch.setattr(engine, "_fold", recording_fold)
    monkeypatch.setattr(link, "next_message", recording_next_message)
    monkeypatch.setattr(engine, "flush_woken", recording_flush)
    # (the core's stream is waiting in the previous next_message: one request to move on)
    split.generate(prompt="Water", max_tokens=2, sampling=pb.SamplingParams(temperature=0))
    events.clear()
    responses = split.generate(prompt="The river", max_tokens=6, ignore_eos=True,
                               sampling=pb.SamplingParams(temperature=0))
    assert len([t for r in responses for t in r.token_ids]) == 6
    first = events.index("fold 1")
    assert events[first + 1] == "flush", events
    assert "down" in events[first + 2:], events
