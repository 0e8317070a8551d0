"""Prometheus metrics of the control plane (prometheus-client), in the style of vLLM's with
the ``headrace:`` prefix (the exporter base is ``headrace.common.metrics``). ``docs/operations.md``
lists them all.

What the scheduler and block manager already count (running / waiting sequences, free blocks,
preemptions, prefix-cache lookups) is read when Prometheus scrapes, so the engine step pays nothing
for it; the engine's per-request histograms are observed once per request. TTFT, inter-token and
end-to-end latency are observed by the request path as it hands responses to the client
(``headrace.controlplane.requests.stream_latency``): in the API front end's process under ``headrace
serve``, summed into the one /metrics like every other front-end metric.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from headrace.common.metrics import PREFIX, STEP_BUCKETS, TOKEN_BUCKETS, Exporter, Histogram
from headrace.controlplane.lora import metrics as lora_metrics
from headrace.v1 import inference_pb2 as pb

# Buckets (seconds) of the request latencies; headrace.common.metrics has the step and token ones.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
               0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_ABORTED: "aborted",
}
STEP_PHASES = ("schedule", "transport", "execute", "process", "device", "sample")


class _EngineState:
    """Collector reading the live engine when scraped: gauges, and the counters the
    scheduler and block manager keep (carried over when a model reload rebuilds them)."""

    def __init__(self, metrics: "ControlPlaneMetrics"):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        sched = getattr(engine, "scheduler", None) if engine is not None else None
        p = PREFIX
        running = GaugeMetricFamily(p + "num_requests_running", "Sequences in the running batch.")
        waiting = GaugeMetricFamily(p + "num_requests_waiting",
                                    "Sequences waiting to be admitted (new or preempted, and "
                                    "parallel samples waiting for their parent's prompt): what "
                                    "--max-queued bounds.")
        usage = GaugeMetricFamily(p + "kv_cache_usage_perc",
                                  "Fraction of KV-cache blocks in use (1 = full).")
        free = GaugeMetricFamily(p + "num_free_kv_blocks",
                                 "KV-cache blocks an allocation can take (free or cached).")
        total = GaugeMetricFamily(p + "num_kv_blocks", "KV-cache blocks in the pool.")
        in_flight = GaugeMetricFamily(p + "num_requests_in_flight",
                                      "Client requests between submission and their last response.")
        ready = GaugeMetricFamily(p + "ready", "1 when the model is loaded and requests are admitted.")
        preempt = CounterMetricFamily(p + "num_preemptions",
                                      "Sequences preempted (their KV recomputed later).")
        queries = CounterMetricFamily(p + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        hits = CounterMetricFamily(p + "prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        base = self.metrics.carried
        if sched is not None:
            blocks = sched.blocks
            running.add_metric([], len(sched.running))
            waiting.add_metric([], sched.num_queued)
            usage.add_metric([], blocks.usage)
            free.add_metric([], blocks.num_free)
            total.add_metric([], blocks.num_blocks)
            preempt.add_metric([], base[0] + sched.num_preemptions)
            queries.add_metric([], base[1] + blocks.prefix_queries)
            hits.add_metric([], base[2] + blocks.prefix_hits)
        else:
            for g in (running, waiting, usage, free, total):
                g.add_metric([], 0)
            for c, b in zip((preempt, queries, hits), base[:3]):
                c.add_metric([], b)
        in_flight.add_metric([], len(engine.requests) if engine is not None else 0)
        ready.add_metric([], 1.0 if engine is not None and engine.ready else 0.0)
        yield from (running, waiting, usage, free, total, in_flight, ready, preempt, queries, hits)
        yield from self._speculation(getattr(sched, "speculation", None))
        if sched is not None:
            yield from _tiers(sched.blocks, base, sched.tier_cost)
        if engine is not None:
            yield from lora_metrics.collect(engine)

    def _speculation(self, spec):
        """vLLM's spec_decode counters (only when the workers speculate)."""
        if spec is None:
            return
        p = PREFIX + "spec_decode_"
        for name, value, doc in (
                ("num_drafts", spec.num_drafts, "Verify steps of a sequence that had drafts."),
                ("num_draft_tokens", spec.num_draft_tokens, "Draft tokens proposed."),
                ("num_accepted_tokens", spec.num_accepted_tokens, "Draft tokens accepted.")):
            c = CounterMetricFamily(p + name, doc)
            c.add_metric([], value)
            yield c
        per_pos = CounterMetricFamily(p + "num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["position"])
        for pos, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([str(pos)], value)
        yield per_pos


def _tiers(blocks, base, cost=None):
    """Per KV tier (device, host): usage, blocks, prefix-cache hits; the blocks the host tier
    exchanged with the device, each way; the host hits its cost rule (``cost``) recomputed,
    and its estimates (``base``: the retired schedulers' counts)."""
    p, host = PREFIX, blocks.host
    usage = GaugeMetricFamily(p + "kv_tier_usage_perc", "Fraction of a KV tier's blocks holding "
                              "KV (device: in use; host: cached or swapped).", labels=["tier"])
    size = GaugeMetricFamily(p + "kv_tier_blocks", "Blocks of a KV tier.", labels=["tier"])
    hits = CounterMetricFamily(p + "kv_tier_prefix_hits", "Prompt tokens found in the prefix "
                               "cache, by the tier that held them.", labels=["tier"])
    moved = CounterMetricFamily(p + "kv_offload_blocks", "KV blocks copied between the tiers: "
                                "out (device to host), in (host to device).", labels=["direction"])
    host_hits = base[3] + (host.hits if host is not None else 0)
    usage.add_metric(["device"], blocks.usage)
    size.add_metric(["device"], blocks.num_blocks)
    hits.add_metric(["device"], base[2] + blocks.prefix_hits - host_hits)
    hits.add_metric(["host"], host_hits)
    moved.add_metric(["out"], base[4] + (host.blocks_out if host is not None else 0))
    moved.add_metric(["in"], base[5] + (host.blocks_in if host is not None else 0))
    skipped = CounterMetricFamily(p + "kv_tier_host_hits_recomputed", "Prompt tokens found in "
                                  "the host tier that the cost rule (--kv-offloading-policy) "
                                  "recomputed instead of loading.")
    skipped.add_metric([], base[6] + (cost.skipped_tokens if cost is not None else 0))
    if host is not None:
        usage.add_metric(["host"], host.usage)
        size.add_metric(["host"], host.num_blocks)
    yield from (usage, size, hits, moved, skipped)
    if cost is not None:
        estimate = GaugeMetricFamily(p + "kv_tier_seconds_per_token", "The host tier cost "
                                     "rule's estimates: load (a host-tier token copied to the "
                                     "device), recompute (one more token of prefill, from the "
                                     "data plane's prefill profile; 0: not measured).",
                                     labels=["action"])
        estimate.add_metric(["load"], cost.load_s_per_token or 0.0)
        estimate.add_metric(["recompute"], cost.recompute_s_per_token or 0.0)
        yield estimate


def engine_state_collector(metrics: "ControlPlaneMetrics") -> _EngineState:
    """The live engine gauges, to register beside a multiprocess collector."""
    return _EngineState(metrics)


class ControlPlaneMetrics(Exporter):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine = None        # set by the engine; read at scrape time
        # preemptions, prefix queries, prefix hits, host-tier hits, blocks out, blocks in,
        # host hits recomputed of retired schedulers
        self.carried = [0, 0, 0, 0, 0, 0, 0]
        p, r = PREFIX, self.registry
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Time from the request's arrival at the API to its first "
                              "token handed to the client's stream.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between two tokens of a sample handed to the client's "
                             "stream (one observation per token after the sample's first "
                             "response; a response of k tokens counts its gap / k, k times).",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "Time from the request's arrival at the API to its last response "
                             "handed to the client (finished requests, aborted ones excluded).",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds",
                               "Time from arrival to first admission into the running batch.",
                               buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram(p + "request_prefill_time_seconds",
                                 "Time from first admission to the first token (all prefill chunks).",
                                 buckets=REQUEST_BUCKETS, registry=r)
        self.decode = Histogram(p + "request_decode_time_seconds",
                                "Time from the first token to the last.",
                                buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_len = Histogram(p + "request_prompt_tokens", "Prompt length of finished requests.",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram(p + "request_generation_tokens",
                                 "Tokens generated by finished requests (all n samples).",
                                 buckets=TOKEN_BUCKETS, registry=r)
        step = Histogram(p + "step_time_seconds",
                         "Engine step time by phase: schedule (scheduling and building the step "
                         "message), transport (round trip to the data plane minus execute), "
                         "execute (forward pass and sampling on the device, as the data plane "
                         "measured it), process (folding tokens back and streaming them), "
                         "device (the step's device time, its first op to its last), sample "
                         "(sampling's share of it; on a CPU data plane its host time).",
                         ["phase"], buckets=STEP_BUCKETS, registry=r)
        (self.step_schedule, self.step_transport, self.step_execute, self.step_process,
         self.step_device, self.step_sample) = (step.labels(phase) for phase in STEP_PHASES)
        self.step_tokens = Histogram(p + "step_tokens", "Tokens computed per engine step.",
                                     buckets=TOKEN_BUCKETS, registry=r)
        finished = Counter(p + "request_success", "Finished sequences by finish reason.",
                           ["finished_reason"], registry=r)
        self.finished = {code: finished.labels(name) for code, name in FINISH_REASONS.items()}
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests "
                                     "(counted at their first token).", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.errors = Counter(p + "request_errors", "Requests that ended with an error status, by "
                              "method, gRPC status code (HTTP errors by their gRPC equivalent) "
                              "and API (grpc, http).", ["method", "code", "api"], registry=r)
        self.api_requests = Counter(p + "api_requests", "Requests received, by API (grpc, http) "
                                    "and method.", ["api", "method"], registry=r)
        self.dataplane_restarts = Counter(p + "dataplane_restarts", "Data plane restarts by `headrace serve`, by "
            "cause (crash: it had served; load_failure: it died loading; hung: killed after the engine "
            "core's step watchdog found it hung).", ["cause"], registry=r)
        self.dataplane_given_up = Gauge(p + "dataplane_given_up", "1 once `headrace serve` stopped "
                                        "restarting its data plane after repeated load failures.",
                                        multiprocess_mode="max", registry=r)
        self.abandoned_streams = Counter(
            p + "request_abandoned", "Response streams that ended before their last response, by "
            "reason: client_cancel, deadline, disconnect (the client left), server_abort (drain, "
            "reload, data plane lost, shutdown).", ["reason"], registry=r)
        offload = Counter(p + "kv_offload_bytes", "KV bytes the data plane (rank 0) copied between "
                          "its tiers: out (device to host), in (host to device).", ["direction"],
                          registry=r)
        self.offload_out, self.offload_in = offload.labels("out"), offload.labels("in")
        self.offload_seconds = Counter(p + "kv_offload_copy_seconds", "Time the data plane "
                                       "(rank 0) spent copying between its KV tiers (device time "
                                       "on a GPU: the two copy streams' busy time, summed).",
                                       registry=r)
        self.registry.register(_EngineState(self))

    def bind(self, engine) -> None:
        self.engine = engine

    def retire(self, scheduler) -> None:
        """Keeps a scheduler's counts before a reload replaces it (counters stay monotonic)."""
        self.carried[0] += scheduler.num_preemptions
        self.carried[1] += scheduler.blocks.prefix_queries
        self.carried[2] += scheduler.blocks.prefix_hits
        host = scheduler.blocks.host
        if host is not None:
            for i, value in enumerate((host.hits, host.blocks_out, host.blocks_in), 3):
                self.carried[i] += value
        if scheduler.tier_cost is not None:
            self.carried[6] += scheduler.tier_cost.skipped_tokens

    def rpc_error(self, method: str, code: grpc.StatusCode, api: str = "grpc") -> None:
        self.errors.labels(method, code.name, api).inc()

    def abandoned(self, reason: str) -> None:
        self.abandoned_streams.labels(reason).inc()

    def api_request(self, api: str, method: str) -> None:
        self.api_requests.labels(api, method).inc()


def rpc_status(context, exc: BaseException) -> grpc.StatusCode:
    """The status an RPC ended with, from its servicer context and the exception that ended it."""
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - not every context implements code()
        code = None
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        return code
    if isinstance(code, int) and code:
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status
    if isinstance(exc, (GeneratorExit,)) or type(exc).__name__ == "CancelledError":
        try:
            remaining = context.time_remaining()
        except Exception:  # noqa: BLE001
            remaining = None
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts unary RPCs that end with an error status (Generate counts its own, so its
    stream is not wrapped)."""

    def __init__(self, metrics: ControlPlaneMetrics, skip: tuple[str, ...] = ()):
        self.metrics = metrics
        self.skip = skip

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method.startswith(self.skip):
            return handler
        behavior, metrics, name = handler.unary_unary, self.metrics, method.rsplit("/", 1)[-1]

        async def counted(request, context):
            try:
                return await behavior(request, context)
            except BaseException as exc:
                metrics.rpc_error(name, rpc_status(context, exc))
                raise

        return handler._replace(unary_unary=counted)
