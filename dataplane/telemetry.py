"""Metrics (prometheus-client) and step spans (OpenTelemetry) of a data plane worker.

Each worker process exports its own registry on its own port (``--metrics-port``, default
9401). Per step: a few counter/histogram updates (step time, device time and device idle by
step ``kind``: decode, mixed, prefill, verify; steps by kind and ``graph``: how the forward
ran), and a span only when the control plane sent trace context with the step (it does so
only for steps serving sampled requests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from opentelemetry.trace import Link, Status, StatusCode

from headrace.common import tracing
from headrace.common.metrics import PREFIX, STEP_BUCKETS, TOKEN_BUCKETS, Exporter, Histogram

P = PREFIX + "dataplane_"


class _WorkerState:
    """Read when scraped: what the worker serves and its device memory."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        worker = self.service.worker
        ready = GaugeMetricFamily(P + "ready", "1 when a model is loaded and warmed up.")
        ready.add_metric([], 1.0 if worker is not None and self.service.serving else 0.0)
        yield ready
        if worker is None:
            return
        info = GaugeMetricFamily(P + "model_info", "The loaded model (value 1).",
                                 labels=["model", "architecture", "dtype", "device"])
        info.add_metric([worker.cfg.name, worker.cfg.architecture,
                         str(worker.dtype).removeprefix("torch."), str(worker.device)], 1.0)
        yield info
        blocks = GaugeMetricFamily(P + "num_kv_blocks", "KV-cache blocks allocated on the device.")
        blocks.add_metric([], worker.runner.num_blocks)
        yield blocks
        kv = GaugeMetricFamily(P + "kv_cache_bytes", "Bytes of the KV cache.")
        kv.add_metric([], worker.runner.num_blocks * worker.block_bytes)
        yield kv
        startup = GaugeMetricFamily(P + "startup_seconds",
                                    "Load, warm-up, KV allocation and CUDA-graph capture time.")
        startup.add_metric([], worker.startup_seconds)
        yield startup
        graphs = worker.graphs
        for name, text, value in (
                ("cuda_graphs", "CUDA graphs captured (decode sizes, piecewise pieces, LM-head sizes).",
                 graphs.num_graphs if graphs.capture_seconds else 0),
                ("cuda_graph_memory_bytes", "Device memory the CUDA graphs took (measured at capture).",
                 graphs.measured_bytes),
                ("cuda_graph_capture_seconds", "Time the CUDA-graph capture took.", graphs.capture_seconds)):
            gauge = GaugeMetricFamily(P + name, text)
            gauge.add_metric([], value)
            yield gauge
        if worker.device.type == "cuda":
            import torch

            mem = GaugeMetricFamily(P + "device_memory_allocated_bytes",
                                    "Device memory allocated by torch.")
            mem.add_metric([], torch.cuda.memory_allocated(worker.device))
            yield mem


class DataPlaneMetrics(Exporter):
    def __init__(self, service, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.steps = Counter(P + "steps", "Steps executed.", registry=r)
        kind = ["kind"]   # decode, mixed, prefill or verify (headrace.dataplane.forward.step_kind)
        self.execute = Histogram(P + "step_execute_seconds",
                                 "Time to apply a step, run the forward pass and sample (the "
                                 "device time the control plane reports as phase=execute), by "
                                 "step kind.", kind, buckets=STEP_BUCKETS, registry=r)
        self.device = Histogram(P + "step_device_seconds",
                                "Device time of a step, its first op to its last (steps that "
                                "sample), by step kind.", kind, buckets=STEP_BUCKETS, registry=r)
        self.by_graph = Counter(P + "steps_by_graph", "Steps by kind and by how their forward ran: "
                                "graph=full (a whole CUDA graph), piecewise (graphs around eager "
                                "attention) or eager.", ["kind", "graph"], registry=r)
        self.sample = Histogram(P + "step_sample_seconds",
                                "Sampling's time in a step (device time on a GPU, host time on a CPU).",
                                buckets=STEP_BUCKETS, registry=r)
        self.device_idle = Counter(P + "device_idle_seconds",
                                   "Time the device waited between consecutive steps (for the "
                                   "host or for work), by the kind of the step it waited for.",
                                   kind, registry=r)
        self.seqs = Histogram(P + "step_sequences", "Sequences per step.", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.sampled = Counter(P + "sampled_tokens", "Tokens sampled.", registry=r)
        self.errors = Counter(P + "step_errors", "Steps that failed, by gRPC status code.",
                              ["code"], registry=r)
        self.reloads = Counter(P + "model_reloads", "Model reloads by outcome.", ["outcome"],
                               registry=r)
        r.register(_WorkerState(service))
        self._http = None

    def step_done(self, step, result, seconds: float, kind: str = "", graph: str = "") -> None:
        """One step: ``kind`` and ``graph`` as ``Launched`` records them (a step whose every
        sequence had stopped ran nothing: kind and graph ``none``)."""
        kind, graph = kind or "none", graph or "none"
        self.steps.inc()
        self.execute.labels(kind).observe(seconds)
        self.by_graph.labels(kind, graph).inc()
        self.seqs.observe(len(step.new_seqs) + len(step.running_seq_ids))
        if result.token_ids:
            self.sampled.inc(len(result.token_ids))
            self.sample.observe(result.sample_ms / 1e3)
        if result.device_ms:
            self.device.labels(kind).observe(result.device_ms / 1e3)
            self.device_idle.labels(kind).inc(result.device_idle_ms / 1e3)


class StepTracer:
    """The worker's span of a step: child of the control plane's step span, linked to the
    request spans the step serves."""

    def __init__(self):
        self.tracer = tracing.get_tracer("headrace.dataplane")

    def start(self, step):
        if self.tracer is None or not step.trace_context:
            return None
        links = []
        for tp in step.trace_links:
            ctx = tracing.span_context_of(tp)
            if ctx.is_valid:
                links.append(Link(ctx))
        return self.tracer.start_span(
            "headrace.dataplane.step", context=tracing.extract(dict(step.trace_context)),
            links=links, attributes={"headrace.step_id": step.step_id,
                                     "headrace.new_seqs": len(step.new_seqs),
                                     "headrace.running_seqs": len(step.running_seq_ids),
                                     "headrace.finished_seqs": len(step.finished_seq_ids)})

    @staticmethod
    def end(span, result=None, error: BaseException | None = None, launched=None) -> None:
        if span is None:
            return
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        elif result is not None:
            if launched is not None:
                span.set_attributes({"headrace.step_kind": launched.kind or "none",
                                     "headrace.graph": launched.graph or "none"})
            span.set_attributes({"headrace.execute_ms": result.execute_ms,
                                 "headrace.device_ms": result.device_ms,
                                 "headrace.device_idle_ms": result.device_idle_ms,
                                 "headrace.sample_ms": result.sample_ms,
                                 "headrace.sampled_tokens": len(result.token_ids)})
        span.end()
