"""What makes a log line safe to keep (``headrace.common.logs`` wires these in): every line names the
process's role, whatever thread writes it; no line is longer than ``MAX_LINE_BYTES``; an error
that repeats is written once per ``REPEAT_INTERVAL_S`` with how often it came meanwhile.

- ``process_fields``: fields of the process as a whole (``role``, ``frontend``, ``rank``, ...),
  added to every line. They are not context variables: threads (the data plane's gRPC
  workers, the supervisor's watchers) and tasks alike carry them.
- ``capped``: wraps the final renderer. A line over the cap is rendered again with every long
  value cut (an exception's frames first: the outermost and innermost are kept) and, if it is
  still too long, cut itself, saying so (``truncated``).
- ``RepeatFilter``: a warning or error with the same logger, level, message template and
  exception class as one written within the interval is not written; the next one written
  after the interval carries ``repeated`` (how many were left out). A line left out when no
  other of its kind follows is summed up by the next line of any kind once its interval ended.
Tracebacks never show frame locals (they hold requests: prompts, token ids, tensors)."""

from __future__ import annotations

import json
import logging
import threading
import time

MAX_LINE_BYTES = 8192
MAX_VALUE_CHARS = 1024   # a value's share of an over-long line
REPEAT_INTERVAL_S = 10.0

_PROCESS: dict = {}


def set_process_fields(**fields) -> None:
    """Fields every line of this process carries from now on (``None`` removes one)."""
    for key, value in fields.items():
        if value is None:
            _PROCESS.pop(key, None)
        else:
            _PROCESS[key] = value


def process_fields(_logger, _name, event_dict: dict) -> dict:
    for key, value in _PROCESS.items():
        event_dict.setdefault(key, value)
    return event_dict


def _cut(value, limit: int):
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"...[{len(value) - limit} chars cut]"
    if isinstance(value, dict):
        return {k: _cut(v, limit) for k, v in list(value.items())[:32]}
    if isinstance(value, (list, tuple)):
        items = [_cut(v, limit) for v in value[:16]]
        return items + [f"...[{len(value) - 16} items cut]"] if len(value) > 16 else items
    text = repr(value) if not isinstance(value, (int, float, bool, type(None))) else None
    return value if text is None or len(text) <= limit else text[:limit] + "...[cut]"


def _short_exception(exc):
    """A dict traceback (``dict_tracebacks``) with its first two and last three frames."""
    if not isinstance(exc, list):
        return exc
    out = []
    for entry in exc:
        if isinstance(entry, dict) and isinstance(entry.get("frames"), list) and len(entry["frames"]) > 5:
            frames = entry["frames"]
            entry = dict(entry, frames=frames[:2] + [{"cut": f"{len(frames) - 5} frames"}] + frames[-3:])
        out.append(entry)
    return out


def capped(renderer, limit: int = MAX_LINE_BYTES):
    """``renderer`` whose output is at most ``limit`` bytes (see the module's docstring)."""

    def render(logger, name, event_dict: dict):
        line = renderer(logger, name, dict(event_dict))
        if _size(line) <= limit:
            return line
        shorter = {k: _cut(v, MAX_VALUE_CHARS) for k, v in event_dict.items()}
        if "exception" in shorter:
            shorter["exception"] = _cut(_short_exception(event_dict["exception"]), MAX_VALUE_CHARS)
        shorter["truncated"] = True
        line = renderer(logger, name, shorter)
        if _size(line) <= limit:
            return line
        if isinstance(line, bytes):
            return line[:limit - 16] + b"...[truncated]"
        if line.lstrip().startswith("{"):   # JSON: still one parseable object
            keep = {k: shorter[k] for k in ("event", "level", "logger", "timestamp", "role")
                    if k in shorter}
            keep["event"] = str(keep.get("event", ""))[:limit // 2]
            keep["truncated"] = True
            return json.dumps(keep, default=str)
        return line[:limit - 16] + "...[truncated]"

    return render


def _size(line) -> int:
    if isinstance(line, bytes) or len(line) * 4 <= MAX_LINE_BYTES:   # (no UTF-8 char is longer)
        return len(line)
    return len(line.encode("utf-8", "replace"))


class RepeatFilter(logging.Filter):
    """Writes a repeated warning or error once per ``interval_s`` (see the module's docstring)."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._seen: dict[tuple, list] = {}   # key -> [first written at, left out since, a record]
        self._lock = threading.Lock()
        self._local = threading.local()   # set while a summary is handed on (not filtered)
        self.handler: logging.Handler | None = None   # where summaries of quiet keys go

    @staticmethod
    def key(record: logging.LogRecord) -> tuple:
        msg = record.msg
        if isinstance(msg, dict):   # structlog's event dict (wrap_for_formatter)
            event, exc, exc_class = msg.get("event"), msg.get("exception"), None
            if isinstance(exc, list) and exc and isinstance(exc[0], dict):   # dict_tracebacks'
                exc_class = exc[0].get("exc_type")
            elif isinstance(exc, str):   # a rendered traceback: its last line names the class
                exc_class = exc.strip().rsplit("\n", 1)[-1].split(":", 1)[0]
        else:
            event, exc_class = msg, None
        if record.exc_info and record.exc_info[0] is not None:
            exc_class = record.exc_info[0].__name__
        return record.name, record.levelno, str(event), exc_class

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._local, "summing", False):
            return True
        now = self.clock()
        key = self.key(record) if record.levelno >= logging.WARNING else None
        self._sum_up_quiet(now, key)
        if key is None:
            return True
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                seen[2] = record
                return False
            left_out = seen[1] if seen is not None else 0
            self._seen[key] = [now, 0, None]
            if len(self._seen) > 512:   # forget the oldest kinds
                for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:256]:
                    del self._seen[old]
        if left_out:
            _add_field(record, "repeated", left_out)
        return True

    def _sum_up_quiet(self, now: float, current: tuple | None) -> None:
        """Lines left out of kinds whose interval ended with none written since: one summary
        each (the last one left out, with its count); not the ``current`` line's kind, which
        carries its count itself."""
        if self.handler is None:
            return
        with self._lock:
            due = [(k, v) for k, v in self._seen.items()
                   if v[1] and now - v[0] >= self.interval_s and k != current]
            for key, value in due:
                self._seen[key] = [now, 0, None]
        for _, (_, count, record) in due:
            _add_field(record, "repeated", count)
            self._local.summing = True
            try:
                self.handler.handle(record)
            finally:
                self._local.summing = False


def _add_field(record: logging.LogRecord, key: str, value) -> None:
    if isinstance(record.msg, dict):
        record.msg = dict(record.msg, **{key: value})
    else:
        setattr(record, key, value)
