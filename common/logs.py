"""Structured logs (structlog) for both planes.

JSON lines by default when stderr is not a terminal (containers, log shippers), readable
console lines in a terminal; ``HEADRACE_LOG_FORMAT=json|console`` or ``--log-format``
decides explicitly. Records of the standard ``logging`` module (our own modules, grpc,
opentelemetry) go through the same renderer. Context bound with
``structlog.contextvars`` (the request id and trace id while a request handler runs) is
merged into every line of that task; the engine loop, which serves many requests, passes
them explicitly. Prompt text is never logged unless ``--log-prompts`` asks for it.

Every line is safe to keep (``headrace.common.log_safety``): it names the process's role (from any
thread), tracebacks show no frame locals (they hold requests: prompts, token ids, tensors), no
line is over 8 KB, and a repeated warning or error is written once per interval with a count.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from headrace.common import log_safety
from headrace.common.log_safety import set_process_fields  # noqa: F401  (the role's fields: headrace.cli.main)

LOG_FORMATS = ("json", "console")


def _format(fmt: str | None, stream) -> str:
    fmt = (fmt or os.environ.get("HEADRACE_LOG_FORMAT") or "").lower()
    if fmt in LOG_FORMATS:
        return fmt
    return "console" if getattr(stream, "isatty", lambda: False)() else "json"


def _drop_color_message(_logger, _name, event_dict: dict) -> dict:
    """uvicorn hands its records a copy of the message with ANSI colour codes as the extra
    ``color_message``; our lines render ``event`` (coloured only on a terminal) and drop it."""
    event_dict.pop("color_message", None)
    return event_dict


def configure_logging(fmt: str | None = None, level: str | int | None = None, stream=None,
                      cache_loggers: bool = True) -> str:
    """Configures structlog and the standard ``logging`` root; returns the format chosen."""
    stream = stream or sys.stderr
    fmt = _format(fmt, stream)
    level = level or os.environ.get("HEADRACE_LOG_LEVEL", "INFO")
    shared = [
        structlog.contextvars.merge_contextvars,
        log_safety.process_fields,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        _drop_color_message,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.ExceptionRenderer(
            ExceptionDictTransformer(show_locals=False, max_frames=20)))
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", lambda: False)(),
                                                 exception_formatter=structlog.dev.plain_traceback)
    renderer = log_safety.capped(renderer)
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=cache_loggers,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    repeats = log_safety.RepeatFilter()
    repeats.handler = handler
    handler.addFilter(repeats)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else str(level).upper())
    return fmt


def configure_library_default() -> None:
    """Until ``configure_logging`` runs (headrace embedded in another program, tests), our
    structlog loggers hand their events to the standard ``logging`` module like any library:
    the host program's handlers and levels decide what is shown."""
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.render_to_log_kwargs],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str):
    return structlog.stdlib.get_logger(name)


if not structlog.is_configured():
    configure_library_default()
