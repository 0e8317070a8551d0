"""Traces and metrics: the span tree of one request across both planes (in-memory exporter),
preemption events, every Prometheus metric moving as expected for a small workload, both
/metrics endpoints, and tracing costing nothing when it is off."""

from __future__ import annotations

import concurrent.futures
import random
import time
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from headrace.common import tracing
from headrace.controlplane.engine.loop import EngineConfig
from headrace.common.metrics import Histogram
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from headrace.v1 import inference_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0)
SERVER_SPAN = "/headrace.v1.Inference/Generate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama-tel"), "llama", heads=4, kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def traced(model_dir):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable_tracing(provider)
    try:
        planes = Planes(model_dir, num_kv_blocks=8, config=EngineConfig(max_batched_tokens=32))
    finally:
        tracing.disable_tracing()   # planes built later in this process do not trace
    yield planes, exporter
    planes.close()


def _spans_of(exporter, trace_id: int, expect_server: int = 1, timeout: float = 10.0):
    """The finished spans of a trace, once its server span(s) ended (just after the stream)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if sum(s.name == SERVER_SPAN for s in spans) >= expect_server or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def _traceparent(rng: random.Random) -> tuple[str, int, int]:
    trace_id, span_id = rng.getrandbits(128), rng.getrandbits(64)
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def test_span_tree_of_one_request_across_both_planes(traced):
    planes, exporter = traced
    header, trace_id, client_span = _traceparent(random.Random(1))
    prompt = list(range(2, 82))   # 80 tokens: three prefill chunks of at most 32
    responses = list(planes.stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=5, ignore_eos=True, sampling=GREEDY),
        metadata=[("traceparent", header)], timeout=60))
    assert completion(responses)[2] == pb.FINISH_REASON_LENGTH
    spans = _spans_of(exporter, trace_id)
    by_id = {s.context.span_id: s for s in spans}
    named = lambda name: [s for s in spans if s.name == name]  # noqa: E731

    # the client's traceparent is honoured: the server span continues the caller's trace
    (server,) = named(SERVER_SPAN)
    assert server.parent.span_id == client_span and server.parent.is_remote
    assert server.attributes["headrace.prompt_tokens"] == 80
    assert server.attributes["headrace.completion_tokens"] == 5
    sid = server.context.span_id

    (queue,) = named("headrace.queue")
    assert queue.parent.span_id == sid
    chunks = sorted(named("headrace.prefill"), key=lambda s: s.attributes["headrace.position"])
    assert [c.attributes["headrace.tokens"] for c in chunks] == [32, 32, 16]
    assert [c.attributes["headrace.position"] for c in chunks] == [0, 32, 64]
    assert all(c.parent.span_id == sid for c in chunks)
    assert queue.end_time <= chunks[0].start_time
    (decode,) = named("headrace.decode")
    assert decode.parent.span_id == sid
    assert [e.name for e in decode.events] == ["first_token", "finish"]
    assert decode.events[1].attributes["headrace.finish_reason"] == "length"
    assert decode.events[1].attributes["headrace.completion_tokens"] == 5

    # one control plane step span per engine step (3 prefill chunks + 4 decodes), each the
    # child of the chunk or the decode it advanced; the data plane's step span is its child
    steps = named("headrace.step")
    assert len(steps) == 7
    assert sorted(by_id[s.parent.span_id].name for s in steps) == \
        ["headrace.decode"] * 4 + ["headrace.prefill"] * 3
    workers = named("headrace.dataplane.step")
    assert len(workers) == 7
    step_ids = {s.context.span_id for s in steps}
    for w in workers:
        assert w.parent.span_id in step_ids and w.parent.is_remote
        assert w.instrumentation_scope.name == "headrace.dataplane"
        # the worker's span links to the request span the step served
        assert [link.context.trace_id for link in w.links] == [trace_id]
        assert by_id[w.links[0].context.span_id].name in ("headrace.prefill", "headrace.decode")
        assert w.attributes["headrace.execute_ms"] > 0
    assert {s.instrumentation_scope.name for s in steps} == {"headrace.controlplane"}


def test_steps_serving_two_requests_link_both(traced):
    planes, exporter = traced
    rng = random.Random(2)
    (h1, t1, _), (h2, t2, _) = _traceparent(rng), _traceparent(rng)
    calls = [planes.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5 + i] * 10),
                                                     max_tokens=20, ignore_eos=True),
                                  metadata=[("traceparent", h)], timeout=60)
             for i, h in enumerate((h1, h2))]
    for call in calls:
        list(call)
    _spans_of(exporter, t1), _spans_of(exporter, t2)
    shared = [s for s in exporter.get_finished_spans() if s.name == "headrace.dataplane.step"
              and {link.context.trace_id for link in s.links} == {t1, t2}]
    assert shared, "some step served both requests and links to both"


def test_preemption_is_an_event_of_the_decode_span(traced):
    planes, exporter = traced
    before = planes.engine.scheduler.num_preemptions
    rng = random.Random(3)
    headers = [_traceparent(rng) for _ in range(2)]
    # 8 blocks of 16 tokens; each request grows to 100 tokens (7 blocks): one must yield
    calls = [planes.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[7 + i] * 20),
                                                     max_tokens=80, ignore_eos=True),
                                  metadata=[("traceparent", h)], timeout=60)
             for i, (h, _, _) in enumerate(headers)]
    for call in calls:
        assert completion(list(call))[2] == pb.FINISH_REASON_LENGTH
    assert planes.engine.scheduler.num_preemptions > before
    events = []
    for _, trace_id, _ in headers:
        spans = _spans_of(exporter, trace_id)
        for s in spans:
            events += [(s.name, e.name) for e in s.events]
        queues = [s for s in spans if s.name == "headrace.queue"]
        if any(s.attributes.get("headrace.preempted") for s in queues):
            assert any(s.name == "headrace.prefill" and s.attributes["headrace.recompute"] for s in spans)
    assert ("headrace.decode", "preempted") in events


def test_untraced_planes_create_no_spans_and_send_no_context(model_dir, monkeypatch):
    assert tracing.tracer_provider() is None
    planes = Planes(model_dir, num_kv_blocks=16)
    try:
        assert planes.engine.telemetry.tracer is None
        sent = []
        original = planes.engine.workers.send

        async def spy(msg):
            sent.append((dict(msg.trace_context), list(msg.trace_links)))
            return await original(msg)

        monkeypatch.setattr(planes.engine.workers, "send", spy)
        header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        list(planes.stub.Generate(pb.GenerateRequest(prompt="the quick", max_tokens=3),
                                  metadata=[("traceparent", header)], timeout=60))
        assert sent and all(ctx == ({}, []) for ctx in sent)
        assert not planes.engine.telemetry._seqs
    finally:
        planes.close()


OTEL_VARS = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")


def test_tracing_follows_the_otel_environment(monkeypatch):
    assert tracing.tracer_provider() is None
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not tracing.tracing_requested() and not tracing.setup_tracing("x", set_global=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector:4317")
    assert tracing.tracing_requested()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.tracing_requested()
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.tracing_requested()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    try:   # OTLP exporter, default service name
        assert tracing.setup_tracing("headrace-dataplane", set_global=False)
        provider = tracing.tracer_provider()
        assert provider.resource.attributes["service.name"] == "headrace-dataplane"
        assert tracing.get_tracer("t") is not None
    finally:
        tracing.shutdown_tracing()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mesh-llm")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    try:
        assert tracing.setup_tracing("headrace-controlplane", set_global=False)
        assert tracing.tracer_provider().resource.attributes["service.name"] == "mesh-llm"
    finally:
        tracing.shutdown_tracing()
    assert tracing.tracer_provider() is None and tracing.get_tracer("t") is None


# -- metrics -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planes(model_dir):
    p = Planes(model_dir, num_kv_blocks=8)
    yield p
    p.close()


class Samples:
    def __init__(self, registry):
        self.registry = registry

    def __call__(self, name, **labels) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


P = "headrace:"
KINDS = ("decode", "mixed", "prefill", "verify", "none")


def test_every_metric_moves_as_expected(planes):
    cp = Samples(planes.plane.metrics.registry)
    dp = Samples(planes.worker_server.worker_service.metrics.registry)

    def counts():
        return {
            "ttft": cp(P + "time_to_first_token_seconds_count"),
            "itl": cp(P + "inter_token_latency_seconds_count"),
            "e2e": cp(P + "e2e_request_latency_seconds_count"),
            "queue": cp(P + "request_queue_time_seconds_count"),
            "prefill": cp(P + "request_prefill_time_seconds_count"),
            "decode": cp(P + "request_decode_time_seconds_count"),
            "prompt_len": cp(P + "request_prompt_tokens_count"),
            "prompt_len_sum": cp(P + "request_prompt_tokens_sum"),
            "gen_len_sum": cp(P + "request_generation_tokens_sum"),
            "prompt_tokens": cp(P + "prompt_tokens_total"),
            "gen_tokens": cp(P + "generation_tokens_total"),
            "length": cp(P + "request_success_total", finished_reason="length"),
            "stop": cp(P + "request_success_total", finished_reason="stop"),
            "aborted": cp(P + "request_success_total", finished_reason="aborted"),
            "queries": cp(P + "prefix_cache_queries_total"),
            "hits": cp(P + "prefix_cache_hits_total"),
            "preemptions": cp(P + "num_preemptions_total"),
            "invalid": cp(P + "request_errors_total", method="Generate", code="INVALID_ARGUMENT", api="grpc"),
            "cancelled": cp(P + "request_errors_total", method="Generate", code="CANCELLED", api="grpc"),
            **{f"step_{ph}": cp(P + "step_time_seconds_count", phase=ph)
               for ph in ("schedule", "transport", "execute", "process")},
            "dp_steps": dp(P + "dataplane_steps_total"),
            "dp_execute": sum(dp(P + "dataplane_step_execute_seconds_count", kind=k) for k in KINDS),
            **{f"dp_{k}": dp(P + "dataplane_step_execute_seconds_count", kind=k) for k in KINDS},
            "dp_eager": sum(dp(P + "dataplane_steps_by_graph_total", kind=k, graph="eager") for k in KINDS),
            "dp_sampled": dp(P + "dataplane_sampled_tokens_total"),
            "dp_sample_sum": dp(P + "dataplane_step_sample_seconds_sum"),
        }

    def delta(before):
        # a step sent before the last request finished may still be in flight (overlapped
        # scheduling): wait until every scheduled step's result has been processed (and the
        # engine's thread may observe a step between two reads of one snapshot: two
        # snapshots in a row must agree)
        deadline = time.monotonic() + 10
        last, now = None, counts()
        while (now != last or now["step_schedule"] != now["step_process"]) and time.monotonic() < deadline:
            time.sleep(0.01)
            last, now = now, counts()
        return {k: now[k] - before[k] for k in now}

    # -- three requests one after another: every per-request metric moves exactly
    before = counts()
    prompt = list(range(2, 42))   # 40 tokens: two full blocks of 16 can be reused
    streams = [planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=8,
                               ignore_eos=True, sampling=GREEDY),
               planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=4,
                               ignore_eos=True, sampling=GREEDY)]
    a, b = completion(streams[0]), completion(streams[1])
    streams.append(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=8,
                                   stop_token_ids=[a[0][0]], sampling=GREEDY))
    c = completion(streams[2])
    assert (a[2], b[2], c[2]) == (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    d = delta(before)
    for key in ("ttft", "e2e", "queue", "prefill", "decode", "prompt_len"):
        assert d[key] == 3, key
    assert d["prompt_len_sum"] == d["prompt_tokens"] == 120
    assert d["gen_len_sum"] == d["gen_tokens"] == 8 + 4 + 1
    # every token the client got but those of each stream's first response (as a rule the
    # first token alone)
    assert d["itl"] == sum(len(completion(r)[0]) - len(next(m for m in r if m.token_ids).token_ids)
                           for r in streams) <= (8 - 1) + (4 - 1) + (1 - 1)
    assert (d["length"], d["stop"], d["aborted"]) == (2, 1, 0)
    assert d["queries"] >= 120 and d["hits"] == 2 * 32   # b and c reuse a's two full blocks
    steps = d["step_schedule"]
    assert steps >= 8 + 4 + 1 - 3 + 3
    assert d["step_transport"] == d["step_execute"] == d["step_process"] == steps
    # the worker may also have sampled one token for c in a step sent before c's stop token
    # came back (overlapped scheduling wastes at most one slot per request that stops early;
    # whether it does depends on when c arrived relative to b's last steps)
    assert d["dp_steps"] == d["dp_execute"] == steps and d["dp_sampled"] in (13, 13 + 1)
    # by step kind: each request's prompt was a prefill step, its other tokens decodes (a
    # prefill beside a decode is a mixed step); on a CPU every forward runs eagerly, but a step
    # whose one sequence had stopped already ran none: the steps sent past c's stop token
    # before it came back (two at most at the default pipeline depth of 3)
    assert d["dp_prefill"] + d["dp_mixed"] >= 3 and d["dp_decode"] >= 1 and d["dp_verify"] == 0
    assert d["dp_eager"] + d["dp_none"] == steps and d["dp_none"] <= 2
    assert d["dp_sample_sum"] > 0
    assert cp(P + "time_to_first_token_seconds_sum") > 0
    assert cp(P + "step_time_seconds_sum", phase="execute") > 0
    assert cp(P + "step_time_seconds_sum", phase="sample") > 0   # the sampler's share of steps

    # -- gauges while a request runs, and after it was cancelled
    assert cp(P + "num_requests_running") == 0 and cp(P + "num_requests_waiting") == 0
    assert cp(P + "kv_cache_usage_perc") == 0 and cp(P + "num_free_kv_blocks") == 8
    assert cp(P + "num_kv_blocks") == 8 and cp(P + "ready") == 1
    before = counts()
    call = planes.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[9] * 30),
                                                   max_tokens=60, ignore_eos=True), timeout=60)
    next(call)
    assert cp(P + "num_requests_running") == 1 and cp(P + "num_requests_in_flight") == 1
    assert cp(P + "kv_cache_usage_perc") > 0 and cp(P + "num_free_kv_blocks") < 8
    call.cancel()
    assert planes.wait_for_free_blocks(8) == 8
    deadline = time.monotonic() + 5
    while delta(before)["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    d = delta(before)
    assert d["aborted"] == 1 and d["cancelled"] == 1 and d["e2e"] == 0 and d["ttft"] == 1
    assert cp(P + "num_requests_running") == 0 and cp(P + "num_requests_in_flight") == 0

    # -- errors by status code
    with pytest.raises(grpc.RpcError):
        planes.generate(prompt="hi", max_tokens=0)
    deadline = time.monotonic() + 5   # counted as the call ends: the client may see it first
    while delta(before)["invalid"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert delta(before)["invalid"] == 1

    # -- preemption: two requests that cannot both fit the 8-block pool
    before = counts()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: planes.generate(
            prompt_token_ids=pb.TokenIds(ids=[11 + i] * 20), max_tokens=80, ignore_eos=True), range(2)))
    assert all(completion(r)[2] == pb.FINISH_REASON_LENGTH for r in results)
    d = delta(before)
    assert d["preemptions"] >= 1 and d["length"] == 2 and d["gen_tokens"] >= 160


def test_metrics_endpoints_of_both_planes(planes):
    cp_port = planes.plane.metrics.serve(0, "127.0.0.1")
    dp_port = planes.worker_server.worker_service.metrics.serve(0, "127.0.0.1")
    try:
        planes.generate(prompt="the quick", max_tokens=3)
        cp_text = urllib.request.urlopen(f"http://127.0.0.1:{cp_port}/metrics", timeout=10).read().decode()
        dp_text = urllib.request.urlopen(f"http://127.0.0.1:{dp_port}/metrics", timeout=10).read().decode()
    finally:
        planes.plane.metrics.close()
        planes.worker_server.worker_service.metrics.close()
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
                 'step_time_seconds_bucket{le="0.001",phase="schedule"}',
                 'step_time_seconds_count{phase="transport"}', 'step_time_seconds_count{phase="execute"}',
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_free_kv_blocks", 'request_success_total{finished_reason="length"}',
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"\nheadrace:{name}" in cp_text, name
    assert "_created" not in cp_text
    for name in ("dataplane_steps_total", "dataplane_step_execute_seconds_bucket",
                 "dataplane_sampled_tokens_total", "dataplane_ready 1.0", "dataplane_num_kv_blocks 8.0",
                 'dataplane_model_info{architecture="LlamaForCausalLM"'):
        assert f"\nheadrace:{name}" in dp_text, name


def test_observe_n_counts_one_value_n_times():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    h = Histogram("t", "t", buckets=(0.1, 1.0), registry=registry)
    h.observe_n(0.5, 7)
    h.observe_n(0.05, 2)
    h.observe_n(3.0, 0)
    get = registry.get_sample_value
    assert get("t_bucket", {"le": "0.1"}) == 2 and get("t_bucket", {"le": "1.0"}) == 9
    assert get("t_count") == 9 and get("t_sum") == pytest.approx(3.6)
