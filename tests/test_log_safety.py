"""Logs safe to keep (common/log_safety.py through common/logs.py): a traceback shows no frame
locals (they held whole step requests: token ids, tensors), no line is over 8 KB, a repeated
error is written once per interval with a count, and every line of every thread names the
process's role. And the failpoints (common/failpoints.py): off by default, parsed strictly,
acting only on their conditions."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from headrace.common import failpoints, log_safety
from headrace.common.logs import (configure_library_default, configure_logging, get_logger,
                                  set_process_fields)


@pytest.fixture
def lines():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    configure_logging("json", stream=buf, cache_loggers=False)
    yield lambda: [json.loads(line) for line in buf.getvalue().splitlines()]
    set_process_fields(role=None, rank=None)
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    configure_library_default()


def _step(request_token_ids):
    secret_tensor = list(range(70_000))   # noqa: F841 - a frame local that must not be logged
    raise IndexError("index 99 is out of bounds")


def test_tracebacks_show_no_locals_and_lines_stay_under_8kb(lines):
    try:
        _step([31337, 4242, 27182, 16180] * 5000)
    except IndexError:
        logging.getLogger("headrace.dataplane").exception("step %d failed", 7)
    get_logger("headrace.x").warning("big", payload="y" * 50_000, items=list(range(10_000)))
    (step, big) = lines()
    text = json.dumps(step)
    assert step["exception"][0]["exc_type"] == "IndexError" and "31337" not in text and "70000" not in text
    assert all("locals" not in frame for frame in step["exception"][0]["frames"])
    assert len(json.dumps(big)) <= log_safety.MAX_LINE_BYTES and big["truncated"] is True


def test_a_repeated_error_is_written_once_per_interval_with_a_count():
    clock = [0.0]
    repeats = log_safety.RepeatFilter(interval_s=10, clock=lambda: clock[0])
    out = []

    class Keep(logging.Handler):
        def emit(self, record):
            out.append(record)

    handler = Keep()
    handler.addFilter(repeats)
    repeats.handler = handler
    log = logging.Logger("headrace.t")
    log.addHandler(handler)
    for step in range(5):
        log.error("step %d failed", step)
    log.info("something else")
    assert [r.getMessage() for r in out] == ["step 0 failed", "something else"]
    clock[0] = 11.0
    log.info("later")   # the quiet kind's summary comes with the next line
    assert out[-2].getMessage() == "step 4 failed" and out[-2].repeated == 4
    log.error("step %d failed", 9)   # within the interval of that summary: left out
    assert out[-1].getMessage() == "later"
    clock[0] = 30.0
    log.error("step %d failed", 10)
    assert out[-1].getMessage() == "step 10 failed" and out[-1].repeated == 1


def test_every_line_of_every_thread_names_the_role(lines):
    set_process_fields(role="dataplane", rank=1)
    t = threading.Thread(target=lambda: logging.getLogger("headrace.dataplane").warning("from a thread"))
    t.start()
    t.join()
    get_logger("headrace.y").info("from the main thread")
    assert [(x["role"], x["rank"]) for x in lines()] == [("dataplane", 1)] * 2


def test_failpoints_are_off_by_default_and_act_only_on_their_conditions():
    assert not failpoints.ACTIVE   # (the tests' environment sets none)
    try:
        failpoints.configure("dataplane.sampler=raise(IndexError)@seed=666@after=1@times=1")
        failpoints.hit("dataplane.sampler", seed=[1, 2])      # not its seed
        failpoints.hit("dataplane.sampler", seed=[5, 666])    # its seed, skipped once (after=1)
        with pytest.raises(IndexError, match="failpoint dataplane.sampler"):
            failpoints.hit("dataplane.sampler", seed=[666])
        failpoints.hit("dataplane.sampler", seed=[666])       # times=1: done
        with pytest.raises(failpoints.FailpointError):
            failpoints.parse("nowhere=raise(IndexError)")
        with pytest.raises(failpoints.FailpointError):
            failpoints.parse("core.loop=raise(NotAnException)")
        assert failpoints.parse("core.loop=exit(9)@after=200")["core.loop"].after == 200
    finally:
        failpoints.configure(None)
