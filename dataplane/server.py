"""The data plane's gRPC server: the ``Worker`` service (Describe + the Execute step stream)
and ``grpc.health.v1``.

Only one control plane drives a worker at a time: a new Execute stream resets the mirror
and supersedes the previous stream, which then ends with ``ABORTED``.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dataplane.runner import StepError
from dataplane.worker import Worker
from headrace.dataplane.v1 import worker_pb2 as pb
from headrace.dataplane.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("headrace.dataplane")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, worker: Worker):
        self.worker = worker
        self._lock = threading.Lock()   # one step at a time on the device
        self._generation = 0

    def Describe(self, request, context):
        return self.worker.describe()

    def Execute(self, request_iterator, context):
        with self._lock:
            self._generation += 1
            generation = self._generation
            self.worker.runner.reset()
        for step in request_iterator:
            with self._lock:
                if generation != self._generation:
                    context.abort(grpc.StatusCode.ABORTED, "superseded by a newer control plane stream")
                try:
                    result = self.worker.runner.execute(step)
                except StepError as exc:
                    self.worker.runner.reset()
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {step.step_id}: {exc}")
                except Exception as exc:  # device errors: report, do not kill the process
                    log.exception("step %d failed", step.step_id)
                    self.worker.runner.reset()
                    context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {exc!r}")
            yield result


def serve(worker: Worker, address: str) -> grpc.Server:
    """Starts serving on ``address`` (``host:port`` or ``unix:/path``) and returns the server."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerService(worker), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
        raise RuntimeError(f"cannot bind {address}")
    server.start()
    for name in ("", pb.DESCRIPTOR.services_by_name["Worker"].full_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server
