"""OpenTelemetry tracing for both planes: set-up from the standard OTEL_* variables and the
helpers that carry W3C trace context across gRPC metadata and step messages.

Tracing is on when the standard OTEL_* variables ask for an exporter
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or
``OTEL_TRACES_EXPORTER=otlp|console``) and ``OTEL_SDK_DISABLED`` is not true; the
service name comes from ``OTEL_SERVICE_NAME`` (default ``headrace-controlplane`` /
``headrace-dataplane``), the sampler from ``OTEL_TRACES_SAMPLER``. When it is off, no
tracer exists: no interceptor is installed, the engine's hooks skip every span, and steps
carry no trace context.
"""

from __future__ import annotations

import os
import random
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from headrace.common.logs import get_logger

_W3C = TraceContextTextMapPropagator()
_provider = None   # the SDK TracerProvider when tracing is on
_owned = False     # whether we created it (and so shut it down)


# -- set-up ----------------------------------------------------------------------------------
def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def tracing_requested() -> bool:
    if _truthy("OTEL_SDK_DISABLED"):
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(default_service_name: str, set_global: bool = True) -> bool:
    """Builds the tracer provider from the OTEL_* environment (and makes it the global one);
    returns whether tracing is on."""
    global _owned
    if _provider is not None:
        return True
    if not tracing_requested():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {"service.version": _version()}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = default_service_name
    provider = TracerProvider(resource=Resource.create(attrs))
    exporters = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")]
    for name in exporters:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                      os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
            if protocol != "grpc":
                get_logger("headrace.telemetry").warning(
                    "only OTLP over gRPC is installed; ignoring the requested protocol",
                    protocol=protocol)
            from headrace.common.trace_export import OneWarningExporter

            endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "")
            provider.add_span_processor(BatchSpanProcessor(OneWarningExporter(OTLPSpanExporter(), endpoint)))
        elif name and name != "none":
            get_logger("headrace.telemetry").warning("unknown OTEL_TRACES_EXPORTER", exporter=name)
    enable_tracing(provider, set_global=set_global)
    _owned = True
    return True


def enable_tracing(provider, set_global: bool = False) -> None:
    """Turns tracing on with ``provider`` (tests pass one with an in-memory exporter).
    Planes built afterwards trace; those built before do not."""
    global _provider
    _provider = provider
    if set_global:
        trace.set_tracer_provider(provider)


def disable_tracing() -> None:
    global _provider, _owned
    _provider, _owned = None, False


def shutdown_tracing() -> None:
    """Flushes and stops the exporter we created."""
    if _provider is not None and _owned:
        _provider.shutdown()
    disable_tracing()


def tracer_provider():
    return _provider


def get_tracer(name: str):
    """The tracer for ``name``, or None when tracing is off."""
    return None if _provider is None else _provider.get_tracer(name, _version())


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("headrace")
    except Exception:  # noqa: BLE001
        return "0"


# -- helpers ---------------------------------------------------------------------------------
def epoch_ns(monotonic_t: float) -> int:
    """A ``time.monotonic()`` instant as nanoseconds since the epoch (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_t) * 1e9)


def traceparent(span_context) -> str:
    return (f"00-{format_trace_id(span_context.trace_id)}-{format_span_id(span_context.span_id)}"
            f"-{int(span_context.trace_flags):02x}")


def inject(span) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier) -> otel_context.Context:
    return _W3C.extract(carrier)


def span_context_of(traceparent_value: str):
    ctx = _W3C.extract({"traceparent": traceparent_value})
    return trace.get_current_span(ctx).get_span_context()


def mark_span_failed(code) -> None:
    """Records a gRPC error status on the current (server) span; a no-op when not tracing.
    Cancellation and deadlines do not pass through the instrumentation's error path."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))


def request_trace_id(metadata) -> str:
    """The trace id of the request being handled: its span's (tracing on), else the caller's
    ``traceparent`` (tracing off here, but on in the mesh), else a fresh random one (an
    unsampled trace, W3C-style) so its log lines can still be correlated."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        return format_trace_id(ctx.trace_id)
    for key, value in metadata or ():
        if key == "traceparent":
            remote = span_context_of(value)
            if remote.is_valid:
                return format_trace_id(remote.trace_id)
            break
    return f"{random.getrandbits(128):032x}"
