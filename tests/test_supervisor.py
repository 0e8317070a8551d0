"""``headrace serve``'s supervisor with stand-in children: a group that dies while loading at
start-up ends serve (no restart loop); crashes after serving restart with exponential backoff
up to a cap; repeated load failures after serving give up (gauge set, restarts counted)."""

from __future__ import annotations

import sys
import threading
import time

from headrace.cli.supervisor import DataPlaneChildren
from headrace.controlplane.metrics import ControlPlaneMetrics


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_load_failure_at_start_up_is_fatal_at_once():
    fatal = threading.Event()
    children = DataPlaneChildren(lambda: [_child("import sys; sys.exit(3)")], {}, poll_s=0.02,
                                 ready=lambda: False)
    try:
        children.when_fatal(fatal.set)
        assert fatal.wait(20)
        assert children.restarts == 0 and children.exit_status == 3
        assert "while loading" in children.given_up
        late = threading.Event()
        children.when_fatal(late.set)   # registered after the fact: called at once
        assert late.is_set()
    finally:
        children.stop()


def test_crashes_after_serving_back_off_exponentially_to_a_cap():
    starts: list[float] = []

    def argvs():
        starts.append(time.monotonic())
        return [_child("import time; time.sleep(0.3)")]   # serves, then crashes (exit 0 counts too)

    metrics = ControlPlaneMetrics()
    children = DataPlaneChildren(argvs, {}, poll_s=0.02, ready=lambda: True, metrics=metrics,
                                 backoff=(0.2, 0.8), stable_s=1000)
    try:
        assert _wait(lambda: len(starts) >= 5, 40)
    finally:
        children.stop()
    assert list(children.delays)[:4] == [0.2, 0.4, 0.8, 0.8]   # doubling, capped
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(gap >= 0.3 + delay for gap, delay in zip(gaps, children.delays)), gaps
    assert not children.fatal and children.given_up is None
    assert metrics.registry.get_sample_value("headrace:dataplane_restarts_total", {"cause": "crash"}) >= 4


def test_repeated_load_failures_after_serving_give_up():
    runs = []

    def argvs():
        runs.append(1)
        if len(runs) == 1:
            return [_child("import time; time.sleep(0.5)")]   # the first group serves, then dies
        return [_child("import sys; sys.exit(3)")]            # its restarts cannot load

    served = lambda: len(runs) == 1   # noqa: E731  (only the first group ever reports SERVING)
    metrics = ControlPlaneMetrics()
    children = DataPlaneChildren(argvs, {}, poll_s=0.02, ready=served, metrics=metrics,
                                 backoff=(0.05, 0.1), max_load_failures=3)
    try:
        assert _wait(lambda: children.given_up is not None, 40)
        time.sleep(0.5)
        assert len(runs) == 4   # the first group and three failed loads; no more
        assert not children.fatal and "3 times in a row" in children.given_up
        assert metrics.registry.get_sample_value("headrace:dataplane_given_up") == 1
        assert metrics.registry.get_sample_value("headrace:dataplane_restarts_total",
                                                 {"cause": "load_failure"}) == 2
    finally:
        children.stop()


def test_the_backoff_starts_over_once_a_group_has_served_long_enough():
    children = DataPlaneChildren(lambda: [_child("import time; time.sleep(0.4)")], {}, poll_s=0.02,
                                 ready=lambda: True, backoff=(0.1, 5.0), stable_s=0.1)
    try:
        assert _wait(lambda: len(children.delays) >= 3, 40)
    finally:
        children.stop()
    assert list(children.delays)[:3] == [0.1, 0.1, 0.1]


def test_a_group_the_core_reports_hung_is_killed_and_restarted():
    starts: list[float] = []
    hung = threading.Event()

    def argvs():
        starts.append(time.monotonic())
        return [_child("import time; time.sleep(60)")]   # alive, never exits by itself

    metrics = ControlPlaneMetrics()
    children = DataPlaneChildren(argvs, {}, poll_s=0.02, ready=lambda: True, metrics=metrics,
                                 backoff=(0.05, 0.1), hung=hung.is_set, hung_poll_s=0.05)
    try:
        assert _wait(lambda: children._serving_since is not None)
        first = children.children[0]
        time.sleep(0.2)
        assert len(starts) == 1 and first.poll() is None   # not hung: left alone
        hung.set()
        assert _wait(lambda: len(starts) == 2)
        hung.clear()
        assert first.poll() is not None and children.killed_hung == 1
        assert metrics.registry.get_sample_value("headrace:dataplane_restarts_total", {"cause": "hung"}) == 1
    finally:
        children.stop()
