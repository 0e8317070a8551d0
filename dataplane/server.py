"""The data plane's gRPC server: the ``Worker`` service (Describe, the Execute step stream,
Reload) and ``grpc.health.v1`` (NOT_SERVING until the model is loaded and warmed up, and
while it reloads), plus its Prometheus exporter and step spans.

Only one control plane drives a worker at a time: a new Execute stream resets the mirror
and supersedes the previous stream, which then ends with ``ABORTED``.

A step that raises (a bug, a device error) does not end the stream: the worker forgets every
sequence and answers that step, every step it had not answered and every step it receives
after on this stream with ``StepResult.error`` (which step raised, the exception's class), so
the control plane can tell it from a lost worker, open a fresh stream and find the sequences
that cause it. A protocol mistake (``BatchError``) still ends the stream with INVALID_ARGUMENT.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from headrace.common import failpoints, net, security, stage_times, tracing
from headrace.common.grpc_options import STEP_MAX_MESSAGE_BYTES, server_options
from headrace.dataplane.input_batch import BatchError
from headrace.dataplane.pipeline import StepPipeline
from headrace.dataplane.read_ahead import ReadAhead
from headrace.dataplane.profiling import StepProfiler
from headrace.dataplane.telemetry import DataPlaneMetrics, StepTracer
from headrace.dataplane.worker import Worker
from headrace.worker.v1 import worker_pb2 as pb
from headrace.worker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("headrace.dataplane")

WORKER = pb.DESCRIPTOR.services_by_name["Worker"].full_name
ERROR_MESSAGE_CHARS = 300   # of a raised step's exception message, in its results and the log


class StepRaised(Exception):
    """A step raised: ``error`` says which and what (its stream answers every step with it)."""

    def __init__(self, error: pb.StepError):
        super().__init__(error.error_class)
        self.error = error


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, worker: Worker | None, health_servicer: health.HealthServicer | None = None):
        self.worker = worker
        self.health = health_servicer
        self.serving = False
        self._lock = threading.Lock()   # one step at a time on the device
        self._generation = 0
        self.metrics = DataPlaneMetrics(self)
        self.tracer = StepTracer()
        self.metrics_port: int | None = None
        if worker is not None:
            self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        self.serving = serving
        if self.health is not None:
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", WORKER):
                self.health.set(name, status)

    def load(self, make_worker) -> Worker:
        """Loads and warms up the model (health NOT_SERVING until it is ready)."""
        worker = make_worker()
        with self._lock:
            self.worker = worker
            self.set_serving(True)
        return worker

    def _require_worker(self, context) -> Worker:
        worker = self.worker
        if worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        return worker

    def Describe(self, request, context):
        return self._require_worker(context).describe()

    def Execute(self, request_iterator, context):
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._require_worker(context).runner.reset()
        metrics, tracer, clock = self.metrics, self.tracer, time.perf_counter
        started = {}   # step id -> (span, t0) of steps launched and not yet finished
        profiler = StepProfiler(self.worker.rank, self.worker.device)   # Admin StartProfile
        current = [0]   # the step being launched or finished (the one that raised, if one does)

        def finish(step, launched):
            current[0] = step.step_id
            span, t0 = started.pop(step.step_id)
            if stage_times.STAGES is not None:
                stage_times.STAGES.stamp(f"step:{step.step_id}", "w_finish")
            result = self.worker.runner.finish(launched)
            if step.new_seqs or step.running_seq_ids:   # an empty flush is no model step
                metrics.step_done(step, result, clock() - t0, launched.kind, launched.graph)
            tracer.end(span, result, launched=launched)
            profiler.on_result(step, result)
            return result

        def launch(step):
            current[0] = step.step_id
            if failpoints.ACTIVE and (step.new_seqs or step.running_seq_ids):
                failpoints.hit("dataplane.step", step_id=step.step_id, rank=self.worker.rank)
            if stage_times.STAGES is not None:
                stage_times.STAGES.stamp(f"step:{step.step_id}", "w_launch")
            with profiler.step_range(step):
                return self.worker.runner.launch(step)

        try:
            yield from self._steps(request_iterator, context, generation, StepPipeline(
                self.worker.runner, finish, launch), started, profiler, current)
        finally:
            profiler.close()

    def _steps(self, request_iterator, context, generation, pipeline, started, profiler, current):
        clock = time.perf_counter
        unanswered: collections.deque[int] = collections.deque()   # step ids, in order
        failed: pb.StepError | None = None   # once a step raised: every step's answer

        def answers(ready):
            for result in _answers(ready):
                while unanswered and unanswered[0] <= result.step_id:
                    unanswered.popleft()
                yield result

        for step in ReadAhead(request_iterator, "execute-read-ahead"):
            if stage_times.STAGES is not None:   # (a benchmark's timestamps: bench.late_mask_hops)
                stage_times.STAGES.stamp(f"step:{step.step_id}", "w_late" if step.late_bitmask else "w_read")
            if failed is not None:   # nothing runs on this stream any more; each step is answered
                if generation != self._generation:
                    context.abort(grpc.StatusCode.ABORTED, "superseded by a newer control plane stream")
                if not step.late_bitmask:
                    yield pb.StepResult(step_id=step.step_id, error=failed)
                continue
            span = self.tracer.start(step)
            try:
                with self._lock:
                    if not step.late_bitmask:   # (that only completes a step started before)
                        started[step.step_id] = (span, clock())
                        unanswered.append(step.step_id)
                        profiler.on_submit(step)
                    ready = self._submit(context, generation, step, span, lambda: pipeline.submit(step),
                                         current)
                yield from answers(ready)
                while pipeline.deferred is not None:   # launched once the answer before it is out
                    deferred = pipeline.deferred
                    with self._lock:
                        ready = self._submit(context, generation, deferred,
                                             started.get(deferred.step_id, (None,))[0], pipeline.resume,
                                             current)
                    yield from answers(ready)
            except StepRaised as exc:
                failed = exc.error
                for span, _ in started.values():
                    self.tracer.end(span, error=exc)
                started.clear()
                for step_id in unanswered:
                    yield pb.StepResult(step_id=step_id, error=failed)
                unanswered.clear()
        if failed is None:
            with self._lock:
                ready = pipeline.drain()
            yield from ready

    def _submit(self, context, generation, step, span, call, current):
        """``call`` (the pipeline's, for ``step``) under the lock; a superseded stream, a
        protocol mistake or a device error ends the stream with its status."""
        metrics, tracer = self.metrics, self.tracer
        current[0] = step.step_id   # (launch and finish name theirs, maybe the step before)
        if generation != self._generation:
            tracer.end(span, error=RuntimeError("superseded"))
            metrics.errors.labels("ABORTED").inc()
            context.abort(grpc.StatusCode.ABORTED, "superseded by a newer control plane stream")
        try:
            return call()
        except BatchError as exc:
            tracer.end(span, error=exc)
            metrics.errors.labels("INVALID_ARGUMENT").inc()
            self.worker.runner.reset()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {step.step_id}: {exc}")
        except Exception as exc:  # a bug or a device error: answered, the stream goes on
            message = (str(exc).strip().splitlines() or [""])[0][:ERROR_MESSAGE_CHARS]
            log.error("step %d raised %s; every sequence is forgotten and the control plane told",
                      current[0], type(exc).__name__, exc_info=exc)
            tracer.end(span, error=exc)
            metrics.errors.labels("INTERNAL").inc()
            self.worker.runner.reset()
            raise StepRaised(pb.StepError(step_id=current[0], error_class=type(exc).__name__,
                                          message=message)) from None

    def LoadAdapter(self, request, context):
        """Reads a LoRA adapter into the host cache, beside the steps (not under their lock)."""
        from headrace.dataplane.lora.adapter import AdapterError, AdapterNotFound

        worker = self._require_worker(context)
        try:
            return worker.load_adapter(request)
        except AdapterNotFound as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except AdapterError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:   # the host cache is full
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    def DropAdapters(self, request, context):
        worker = self._require_worker(context)
        if worker.lora is not None:
            worker.lora.slots.drop(list(request.adapter_ids), request.below_id)
        return pb.DropAdaptersResponse()

    def Reload(self, request, context):
        """Frees the old model, loads the new one; puts the old one back if that fails."""
        with self._lock:   # after the step in progress
            self._generation += 1   # the open Execute stream is superseded
            old = self._require_worker(context)
            opts, rank, world = old.opts, old.rank, old.world_size
            new_opts = dataclasses.replace(opts, model=request.model or opts.model)
            self.set_serving(False)
            self.worker = old = None
            _free_device_memory()
            start = time.perf_counter()
            try:
                self.worker = Worker(new_opts, rank, world)
            except Exception as exc:  # noqa: BLE001 - bad checkpoint, out of memory, ...
                log.exception("reloading %s failed; loading %s back", new_opts.model, opts.model)
                self.metrics.reloads.labels("failed").inc()
                _free_device_memory()
                try:
                    self.worker = Worker(opts, rank, world)
                    self.set_serving(True)
                except Exception:  # noqa: BLE001
                    log.exception("loading %s back failed too", opts.model)
                    context.abort(grpc.StatusCode.INTERNAL, f"cannot load {new_opts.model!r} ({exc!r}) "
                                                            f"nor {opts.model!r} back")
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"cannot load {new_opts.model!r}: {exc!r}; {opts.model!r} is loaded again")
            self.set_serving(True)
            self.metrics.reloads.labels("ok").inc()
            log.info("model %s loaded in %.1fs (%s): %d KV blocks", self.worker.cfg.name,
                     time.perf_counter() - start, self.worker.phases.summary(),
                     self.worker.runner.num_blocks)
            return self.worker.describe()


def _answers(results):
    """Yields each result; with stage times on, stamped before and once gRPC has written it."""
    if stage_times.STAGES is None:
        yield from results
        return
    for result in results:
        stage_times.STAGES.stamp(f"step:{result.step_id}", "w_answer")
        yield result
        stage_times.STAGES.stamp(f"step:{result.step_id}", "w_written")


def _free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def serve(worker: Worker | None, address: str, *, metrics_port: int | None = None,
          metrics_host: str = "127.0.0.1", credentials: grpc.ServerCredentials | None = None,
          secret: str | None = None) -> grpc.Server:
    """Starts serving on ``address`` (``host:port`` or ``unix:/path``) and returns the server;
    ``server.worker_service`` is the ``WorkerService``. With no ``worker`` yet, health is
    NOT_SERVING and Describe/Execute answer UNAVAILABLE until ``worker_service.load(...)``.
    ``metrics_port``: None serves no /metrics, 0 an ephemeral port. ``credentials``: TLS (mutual
    with a client CA); ``secret``: only callers presenting it (the control plane) are served."""
    interceptors = [security.SharedSecretInterceptor(secret)] if secret else []
    provider = tracing.tracer_provider()
    if provider is not None:
        from opentelemetry.instrumentation.grpc import filters, server_interceptor

        quiet = filters.any_of(filters.method_name("Execute"), filters.health_check())
        interceptors.append(server_interceptor(tracer_provider=provider, filter_=filters.negate(quiet)))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=server_options(STEP_MAX_MESSAGE_BYTES), interceptors=interceptors)
    health_servicer = health.HealthServicer()
    service = WorkerService(None, health_servicer)
    service.set_serving(False)
    if worker is not None:
        service.worker = worker
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if metrics_port is not None:   # a port in use fails start-up (net.PortInUse), as --listen's
        service.metrics_port = service.metrics.serve(metrics_port, metrics_host)
        log.info("data plane metrics on http://%s:%d/metrics", metrics_host, service.metrics_port)
    try:
        server.worker_port = net.bind_exclusive(   # the bound port
            server, address, lambda srv, addr: security.bind(srv, addr, credentials))
    except net.PortInUse:
        service.metrics.close()
        raise
    server.start()
    if worker is not None:
        service.set_serving(True)
    server.worker_service = service
    return server
