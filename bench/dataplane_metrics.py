"""The data plane's step figures for the serving benchmarks, from its Prometheus ``/metrics``
(``--metrics-port``, 9401 by default): a ``snapshot`` before and after a run, and their
``delta``: steps, mean execute and device time per step by step kind (the ``kind`` label of
``headrace:dataplane_step_execute_seconds`` / ``_step_device_seconds``: decode, mixed, prefill,
verify; ``all`` where the data plane does not label them), and the device's busy and idle
seconds with the idle share (``headrace:dataplane_device_idle_seconds``: the gaps between
consecutive steps, when the device waited for the host or for work)."""

from __future__ import annotations

import collections
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

P = "headrace:dataplane_"
FAMILIES = {P + "step_execute_seconds": "execute", P + "step_device_seconds": "device",
            P + "device_idle_seconds": "idle", P + "steps": "steps"}


def snapshot(url: str = "http://127.0.0.1:9401/metrics") -> dict:
    """``parse`` of the page now; {} when it is not there."""
    try:
        return parse(urllib.request.urlopen(url, timeout=5).read().decode())
    except OSError:
        return {}


def parse(text: str) -> dict:
    """{(figure, kind, "sum" | "count" | "total"): value} of a /metrics page."""
    out: dict = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        figure = FAMILIES.get(family.name.removesuffix("_total"))   # (parsers differ on counters)
        if figure is None:
            continue
        for s in family.samples:
            part = s.name.rsplit("_", 1)[-1]
            if part in ("sum", "count", "total"):
                out[(figure, s.labels.get("kind", "all"), part)] += s.value
    return dict(out)


def delta(before: dict, after: dict) -> dict:
    """What happened between two snapshots: per kind, steps and mean execute / device ms; the
    device's busy and idle seconds and its idle share."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    kinds = sorted({k for (figure, k, _) in d if figure == "execute"})
    by_kind = {}
    for kind in kinds:
        n = d.get(("execute", kind, "count"), 0.0)
        if n <= 0:
            continue
        dn = d.get(("device", kind, "count"), 0.0)
        by_kind[kind] = {"steps": int(n),
                         "execute_ms": round(1e3 * d.get(("execute", kind, "sum"), 0.0) / n, 3),
                         "device_ms": round(1e3 * d.get(("device", kind, "sum"), 0.0) / dn, 3) if dn else None}
    busy = sum(v for (figure, _, part), v in d.items() if figure == "device" and part == "sum")
    idle = sum(v for (figure, _, part), v in d.items() if figure == "idle" and part == "total")
    return {"steps_by_kind": by_kind, "device_busy_s": round(busy, 3), "device_idle_s": round(idle, 3),
            "device_idle_share": round(idle / (busy + idle), 3) if busy + idle > 0 else None}
