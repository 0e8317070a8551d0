"""An absent OpenTelemetry collector costs one warning, not a stream of errors; export that
recovers says so once."""

from __future__ import annotations

import logging
import socket

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from headrace.common.trace_export import OneWarningExporter


def _spans(n: int = 1):
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    spans = []
    for _ in range(n):
        with tracer.start_as_current_span("s") as span:
            spans.append(span)
    return spans


def test_an_unreachable_collector_is_one_warning(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed once the block ends
    inner = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=1)
    exporter = OneWarningExporter(inner, f"127.0.0.1:{port}")
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            assert exporter.export(_spans()) == SpanExportResult.FAILURE
    exporter.shutdown()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot export traces" in warnings[0].getMessage()


def test_recovery_is_said_once(caplog):
    results = [SpanExportResult.FAILURE, SpanExportResult.FAILURE, SpanExportResult.SUCCESS,
               SpanExportResult.SUCCESS]

    class Flaky(SpanExporter):
        def export(self, spans):
            return results.pop(0)

    exporter = OneWarningExporter(Flaky(), "collector:4317")
    with caplog.at_level(logging.INFO, logger="headrace.telemetry"):
        for _ in range(4):
            exporter.export([])
    messages = [r.getMessage() for r in caplog.records if r.name == "headrace.telemetry"]
    assert len(messages) == 2 and "works again" in messages[1]


def test_tracing_set_up_against_an_absent_collector_warns_once(monkeypatch, caplog):
    from headrace.common import tracing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.setup_tracing("headrace-test", set_global=False)
    try:
        provider = tracing.tracer_provider()
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                with provider.get_tracer("t").start_as_current_span("s"):
                    pass
                provider.force_flush(5000)
    finally:
        tracing.shutdown_tracing()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["headrace.telemetry"], [r.getMessage() for r in warnings]
