"""Prometheus metrics of multi-LoRA serving, read from the engine when scraped (nothing per
step): vLLM's ``lora_requests_info`` gauge (its labels name the adapters with sequences running
and waiting, and the slot count; its value is the time of the scrape, as vLLM's), the
sequences of each adapter, and how often adapters were copied into slots and read from disk
(and how long the reads took)."""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from headrace.common.metrics import PREFIX
from headrace.controlplane.lora import api as lora_api


def collect(engine):
    lora = getattr(engine, "lora", None)
    if lora is None or not lora.enabled:
        return
    counts = lora_api.usage(engine)
    info = GaugeMetricFamily(PREFIX + "lora_requests_info",
                             "Running and waiting LoRA adapters (vLLM's lora_requests_info: the "
                             "labels name them, comma-separated; the value is the scrape's time).",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(lora.max_loras), ",".join(sorted(n for n, (r, _) in counts.items() if r)),
                     ",".join(sorted(n for n, (_, w) in counts.items() if w))], time.time())
    seqs = GaugeMetricFamily(PREFIX + "lora_sequences", "Sequences of each LoRA adapter, by state "
                             "(running; waiting: for their turn, blocks, or a slot).",
                             labels=["lora_adapter", "state"])
    for name, (running, waiting) in sorted(counts.items()):
        seqs.add_metric([name, "running"], running)
        seqs.add_metric([name, "waiting"], waiting)
    adapters = GaugeMetricFamily(PREFIX + "lora_adapters", "LoRA adapters served, and those whose "
                                 "weights are in a device slot or the host caches.", labels=["where"])
    served = lora.adapters()
    adapters.add_metric(["served"], len(served))
    adapters.add_metric(["slot"], sum(a.slot is not None for a in served))
    adapters.add_metric(["host"], sum(a.cached for a in served))
    loads = CounterMetricFamily(PREFIX + "lora_slot_loads", "Adapters copied into a device slot "
                                "(from the data planes' host caches).")
    loads.add_metric([], lora.slots.num_loads if lora.slots is not None else 0)
    reads = CounterMetricFamily(PREFIX + "lora_adapter_reads", "Adapters read from disk into the "
                                "data planes' host caches.")
    reads.add_metric([], lora.num_reads)
    read_time = CounterMetricFamily(PREFIX + "lora_adapter_read_seconds", "Time the reads of "
                                    "adapters into the data planes' host caches took (from the "
                                    "request to every worker's answer).")
    read_time.add_metric([], lora.read_seconds)
    yield from (info, seqs, adapters, loads, reads, read_time)
