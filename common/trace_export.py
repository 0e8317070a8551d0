"""Trace export that fails quietly: an absent or unreachable OpenTelemetry collector costs one
warning (and one line when export works again), not an error every few seconds. Wraps the
OTLP exporter and silences its own per-attempt retry and failure records."""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("headrace.telemetry")
OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class _DropExportFailures(logging.Filter):
    """The OTLP exporter's 'Transient error ... retrying' and 'Failed to export' records."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Transient error") or message.startswith("Failed to export"))


_FILTER = _DropExportFailures()


class OneWarningExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, endpoint: str = ""):
        self.inner, self.endpoint = inner, endpoint or "the OTLP endpoint"
        self.failing = False
        logger = logging.getLogger(OTLP_LOGGER)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

    def export(self, spans) -> SpanExportResult:
        result = self.inner.export(spans)
        if result == SpanExportResult.FAILURE and not self.failing:
            self.failing = True
            log.warning("cannot export traces to %s (is the collector running?); spans are dropped "
                        "until it answers, without further warnings", self.endpoint)
        elif result == SpanExportResult.SUCCESS and self.failing:
            self.failing = False
            log.info("trace export to %s works again", self.endpoint)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
