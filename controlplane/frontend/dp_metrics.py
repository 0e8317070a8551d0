"""The metrics of a server with several data-parallel engine cores (``--data-parallel-size``).

A core reads its engine's live state when scraped (``headrace.controlplane.metrics``: running,
waiting, KV usage, prefix-cache counts, ...), but the control plane serves one /metrics, from core
0. So every core mirrors its state every ``MIRROR_INTERVAL_S`` into multiprocess gauges named
``headrace:core_<name>{core="i"}`` (``StateMirror``; mode ``mostrecent``: a restarted core's values
replace its predecessor's), and core 0's /metrics (``registry``) adds the server's totals under the
usual names (``DataParallelTotals``): sums, KV usage weighted by each core's pool, ``ready`` when
any core is. A gateway (the Gateway API Inference Extension) or an HPA reads a data-parallel pod
like a one-core one; the ``core`` label says which core is busy.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from headrace.common.metrics import PREFIX
from headrace.controlplane.metrics import engine_state_collector

MIRROR_INTERVAL_S = 0.1
CORE_PREFIX = PREFIX + "core_"
WEIGHTED = {PREFIX + "kv_cache_usage_perc": PREFIX + "num_kv_blocks",   # usage -> the pool it is of
            PREFIX + "kv_tier_usage_perc": PREFIX + "kv_tier_blocks"}
MAXED = {PREFIX + "ready", PREFIX + "kv_tier_seconds_per_token"}


class StateMirror:
    """Writes one core's live engine state as ``headrace:core_*{core}`` gauges, now and then."""

    def __init__(self, metrics, core: int, interval_s: float = MIRROR_INTERVAL_S):
        self.collector = engine_state_collector(metrics)
        self.core, self.interval_s = str(core), interval_s
        self.gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}
        self._task: asyncio.Task | None = None

    def write(self) -> None:
        for family in self.collector.collect():
            for sample in family.samples:
                name = CORE_PREFIX + sample.name.removeprefix(PREFIX)
                entry = self.gauges.get(name)
                if entry is None:
                    labels = tuple(sorted(sample.labels))
                    entry = self.gauges[name] = (Gauge(
                        name, f"{family.documentation} (this core's; `core` label)",
                        ("core", *labels), multiprocess_mode="mostrecent", registry=None), labels)
                gauge, labels = entry
                gauge.labels(self.core, *(sample.labels[k] for k in labels)).set(sample.value)

    def start(self) -> None:
        async def run():
            while True:
                self.write()
                await asyncio.sleep(self.interval_s)

        self._task = asyncio.create_task(run(), name="headrace-core-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class DataParallelTotals:
    """Every process's metrics (the multiprocess files) plus the server's totals of the cores'
    mirrored state, under the names a one-core server uses."""

    def __init__(self, path: str | None = None):
        self.source = MultiProcessCollector(None, path)

    def collect(self):
        families = list(self.source.collect())
        yield from families
        values: dict[str, dict[tuple, dict[str, float]]] = {}   # name -> other labels -> core -> v
        docs = {}
        for family in families:
            if not family.name.startswith(CORE_PREFIX):
                continue
            for s in family.samples:
                if "core" not in s.labels:
                    continue
                name = PREFIX + s.name.removeprefix(CORE_PREFIX)
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "core"))
                values.setdefault(name, {}).setdefault(rest, {})[s.labels["core"]] = s.value
                docs[name] = family.documentation.removesuffix(" (this core's; `core` label)")
        for name, series in sorted(values.items()):
            yield self._total(name, docs[name], series, values.get(WEIGHTED.get(name), {}))

    @staticmethod
    def _total(name: str, doc: str, series: dict, weights: dict):
        counter = name.endswith("_total")
        labels = [k for k, _ in next(iter(series))]
        family = (CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels) if counter
                  else GaugeMetricFamily(name, doc, labels=labels))
        for rest, by_core in series.items():
            if name in MAXED:
                value = max(by_core.values())
            elif name in WEIGHTED:
                pool = weights.get(rest, {})
                size = sum(pool.get(core, 0.0) for core in by_core)
                value = sum(v * pool.get(core, 0.0) for core, v in by_core.items()) / size if size else 0.0
            else:
                value = sum(by_core.values())
            family.add_metric([v for _, v in rest], value)
        return family


def registry(path: str | None = None) -> CollectorRegistry:
    """Core 0's /metrics under data parallelism."""
    reg = CollectorRegistry()
    reg.register(DataParallelTotals(path))
    return reg
