"""The base of both planes' Prometheus exporters (prometheus-client): the ``headrace:`` name
prefix, the buckets both planes use, a histogram that can observe one value n times, and the
exporter that serves a plane's registry as /metrics over HTTP.

Each plane has its own registry and its own exporter port; the control plane's processes (an engine
core and its API front ends) write theirs to files under ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client's multiprocess mode) and the core serves their sum (``multiprocess_registry``).
``headrace.controlplane.metrics`` and ``headrace.dataplane.telemetry`` define what each one records."""

from __future__ import annotations

import bisect

import prometheus_client
from prometheus_client import CollectorRegistry

PREFIX = "headrace:"
prometheus_client.disable_created_metrics()   # no *_created series next to counters

# Buckets (seconds / tokens) both planes use; latency buckets reach down to sub-ms GPU steps.
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))   # 1 .. 5M


class Histogram(prometheus_client.Histogram):
    """prometheus-client's histogram plus ``observe_n``: one value seen ``n`` times, in
    one bucket increment (the per-step inter-token latency of every decode token)."""

    def observe_n(self, amount: float, n: int) -> None:
        if n <= 0:
            return
        self._raise_if_not_observable()
        self._sum.inc(amount * n)
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(n)


def enable_multiprocess(directory: str) -> None:
    """Multiprocess mode for this process and the children it starts from now on: metric values
    go to files in ``directory`` (``PROMETHEUS_MULTIPROC_DIR``). prometheus-client picks its
    value class when imported, from the environment; a process that imported it before (the
    ``headrace`` command) switches the class its metrics are created with from now on."""
    import os

    from prometheus_client import values

    os.makedirs(directory, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()


def multiprocess_registry(*collectors) -> CollectorRegistry | None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` set: a registry of every process's metrics summed
    (prometheus-client's multiprocess collector) plus ``collectors`` (live gauges); else None."""
    import os

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    for collector in collectors:
        registry.register(collector)
    return registry


class Exporter:
    """Serves a plane's ``registry`` as /metrics over HTTP (one exporter per plane process)."""

    registry: CollectorRegistry
    _http = None

    def serve(self, port: int, host: str = "0.0.0.0", registry: CollectorRegistry | None = None,
              what: str = "--metrics-port") -> int:
        """Serves /metrics (``registry``, default the plane's own) on an HTTP port (0: an
        ephemeral one); returns the port. A port that cannot be bound is ``PortInUse`` (one
        line naming the option ``what`` to change), which fails start-up as the API ports do:
        a server that silently runs without its metrics is a monitoring gap."""
        from headrace.common.net import PortInUse

        try:
            self._http, _thread = prometheus_client.start_http_server(
                port, addr=host, registry=registry if registry is not None else self.registry)
        except OSError as exc:
            reason = exc.strerror.lower() if exc.strerror else str(exc)
            raise PortInUse(f"cannot serve /metrics on {host}:{port}: {reason} (another server on "
                            f"port {port}? choose another {what}, 0 disables it)") from None
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()       # stops serve_forever (within its 0.5 s poll)
            self._http.server_close()
        self._http = None
