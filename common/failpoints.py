"""Named fault injection for tests (chaos tests, ``bench/chaos.py``): a failpoint is a place in
the code where a test may make something go wrong (raise, stall, crash). Off unless the
environment variable ``HEADRACE_FAILPOINTS`` names some; off, a failpoint costs one attribute
test (``if failpoints.ACTIVE:``) and nothing else.

``HEADRACE_FAILPOINTS="NAME=ACTION[@KEY=VALUE...][;NAME=ACTION...]"``, e.g.
``dataplane.sampler=raise(IndexError)@seed=666`` (the sampler raises IndexError in every step
that samples a row seeded 666: one poisoned request) or ``core.loop=exit(9)@after=200`` (the
engine core dies at its 201st loop turn). Actions: ``raise(ExceptionClass)`` (a built-in
exception class; default RuntimeError), ``sleep(SECONDS)``, ``exit(STATUS)`` (the process ends
at once, as after kill -9), ``hang`` (blocks for good). Conditions: ``KEY=VALUE`` matches when
the call site's fact ``KEY`` is VALUE or contains it (the sampler's ``seed`` is the step's
seeds); ``after=N`` skips the first N matching hits; ``times=N`` acts N times at most.

The failpoints in the code: ``dataplane.step`` (a data plane step, as it is launched; facts
``step_id``, ``rank``), ``dataplane.sampler`` (sampling a step's rows; ``seed``),
``core.loop`` (a turn of the engine loop), ``frontend.stream`` (a front end hands responses to
a client's stream; ``request_id``). Every process of ``headrace serve`` inherits the variable;
each logs a warning at start when failpoints are active (``warn_if_active``)."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import re
import threading
import time

ENV = "HEADRACE_FAILPOINTS"
NAMES = ("dataplane.step", "dataplane.sampler", "core.loop", "frontend.stream")

log = logging.getLogger("headrace.failpoints")


class FailpointError(ValueError):
    """A failpoint specification that cannot be parsed."""


@dataclasses.dataclass
class Failpoint:
    name: str
    action: str                  # raise, sleep, exit, hang
    argument: str = ""
    when: dict = dataclasses.field(default_factory=dict)
    after: int = 0
    times: int | None = None
    hits: int = 0                # matching hits so far
    acted: int = 0

    def matches(self, facts: dict) -> bool:
        for key, want in self.when.items():
            have = facts.get(key)
            if have is None:
                return False
            values = have if isinstance(have, (list, tuple, set, frozenset)) or hasattr(have, "tolist") \
                else [have]
            if hasattr(values, "tolist"):
                values = values.tolist()
            if want not in {str(v) for v in values}:
                return False
        return True


ACTIVE: dict[str, Failpoint] = {}   # empty: every failpoint is off
_lock = threading.Lock()
_SPEC = re.compile(r"^(?P<name>[\w.]+)=(?P<action>raise|sleep|exit|hang)(?:\((?P<arg>[^)]*)\))?(?P<rest>(?:@[^@]+)*)$")


def parse(spec: str) -> dict[str, Failpoint]:
    points = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        m = _SPEC.match(part)
        if m is None:
            raise FailpointError(f"{ENV}: cannot read {part!r} (NAME=ACTION[@KEY=VALUE...])")
        if m["name"] not in NAMES:
            raise FailpointError(f"{ENV}: no failpoint {m['name']!r}; there are {', '.join(NAMES)}")
        point = Failpoint(m["name"], m["action"], m["arg"] or "")
        for cond in filter(None, (m["rest"] or "").split("@")):
            key, _, value = cond.partition("=")
            if key == "after":
                point.after = int(value)
            elif key == "times":
                point.times = int(value)
            else:
                point.when[key] = value
        if point.action == "raise":
            cls = getattr(builtins, point.argument or "RuntimeError", None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                raise FailpointError(f"{ENV}: {point.argument!r} is not a built-in exception class")
        points[point.name] = point
    return points


def configure(spec: str | None) -> None:
    """Sets the active failpoints (None or "": none); tests call it in-process."""
    global ACTIVE
    ACTIVE = parse(spec) if spec else {}


def warn_if_active() -> None:
    """One warning line when failpoints are active (each process, once its logs are set up)."""
    if ACTIVE:
        log.warning("failpoints are active: faults will be injected on purpose",
                    extra={"failpoints": sorted(ACTIVE)})
    elif _bad_spec:
        log.error("%s", _bad_spec)


def hit(name: str, **facts) -> None:
    """The failpoint ``name`` is reached (call only ``if failpoints.ACTIVE``)."""
    point = ACTIVE.get(name)
    if point is None or not point.matches(facts):
        return
    with _lock:
        point.hits += 1
        if point.hits <= point.after or (point.times is not None and point.acted >= point.times):
            return
        point.acted += 1
    if point.action == "raise":
        raise getattr(builtins, point.argument or "RuntimeError")(f"failpoint {name}")
    if point.action == "sleep":
        time.sleep(float(point.argument or 1))
    elif point.action == "exit":
        os._exit(int(point.argument or 9))
    elif point.action == "hang":
        while True:
            time.sleep(3600)


_bad_spec = ""


def _from_environment() -> None:
    global _bad_spec
    spec = os.environ.get(ENV)
    if spec:
        try:
            configure(spec)
        except FailpointError as exc:   # a test's mistake: said at start, and no failpoint acts
            _bad_spec = str(exc)


_from_environment()
