"""The control plane's engine loop: schedule a step, send it to the workers, fold the sampled
tokens back into the sequences and stream each request's new tokens and text to its client.

Runs as one asyncio task. Handlers talk to it through ``submit`` and ``abort``; the engine
appends sampled tokens to the sequences and wakes their request (``Request.notify``); a
request that cannot go on gets a ``Failure``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time

import grpc

from controlplane.block_manager import BlockManager
from controlplane.policy import Policy
from controlplane.request import Failure, Request, Sequence, Status
from controlplane.scheduler import ScheduledStep, Scheduler
from controlplane.telemetry import EngineTelemetry
from controlplane.worker_client import WorkerError, WorkerGroup
from headrace.dataplane.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.engine")


@dataclasses.dataclass
class EngineConfig:
    max_running: int = 256
    max_batched_tokens: int = 2048
    max_model_len: int | None = None   # default: what the workers report (capped by the KV pool)
    policy: Policy = dataclasses.field(default_factory=Policy)
    enable_prefix_cache: bool = True
    watermark: float = 0.01            # fraction of KV blocks admission leaves free
    max_queued: int = 0                # waiting sequences at most (0 = unbounded); RESOURCE_EXHAUSTED
    reconnect_interval_s: float = 1.0
    pipeline_depth: int = 3            # steps in flight; 1 = no overlap (each step answered at once)
    outage_deadline_s: float = 60.0    # requests wait this long for a lost data plane to return
    stream_interval: int = 1           # tokens per streamed message at least, unless a request says



class Engine:
    def __init__(self, workers: WorkerGroup, config: EngineConfig,
                 telemetry: EngineTelemetry | None = None):
        self.workers = workers
        self.config = config
        self.telemetry = telemetry or EngineTelemetry()
        self.telemetry.metrics.bind(self)
        self.draining = False          # no new requests are admitted (Admin.Drain, reload)
        self.on_health_change = None   # callback when ``healthy`` changes
        self.info: wpb.WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0
        self.healthy = False
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._outage_since: float | None = None
        self._to_wake: list[Request] = []   # requests with news, woken once the next step is sent

    async def start(self, timeout: float = 600.0) -> None:
        self._build(await self.workers.describe(timeout))
        await self.workers.open()
        self._set_healthy(True)
        self._task = asyncio.create_task(self._loop(), name="headrace-engine")

    def _build(self, infos: list[wpb.WorkerInfo]) -> None:
        """(Re)builds the KV block pool and the scheduler for what the workers serve."""
        if self.scheduler is not None:
            self.telemetry.metrics.retire(self.scheduler)
        self.info = infos[0]
        cfg = self.config
        blocks = BlockManager(self.workers.num_kv_blocks, self.info.block_size, cfg.enable_prefix_cache)
        # Every request must fit the KV pool alone, so preemption always makes progress.
        limit = min(self.info.max_model_len, blocks.num_blocks * blocks.block_size)
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        # A step may hold no more than every worker can run.
        max_running = min([cfg.max_running] + [i.max_num_seqs for i in infos if i.max_num_seqs])
        max_tokens = min([cfg.max_batched_tokens] + [i.max_batched_tokens for i in infos
                                                      if i.max_batched_tokens])
        self.scheduler = Scheduler(blocks, max_running, max_tokens, cfg.policy, cfg.watermark)

    @property
    def ready(self) -> bool:
        """The model is loaded, the data plane answers and requests are admitted."""
        return self.healthy and not self.draining and self.scheduler is not None

    def _set_healthy(self, healthy: bool) -> None:
        changed, self.healthy = healthy != self.healthy, healthy
        if changed and self.on_health_change is not None:
            self.on_health_change()

    async def pause(self) -> None:
        """Stops the engine loop and the step streams (Admin reload; nothing in flight)."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.workers.close_streams()
        self._set_healthy(False)

    async def restart(self, infos: list[wpb.WorkerInfo] | None) -> None:
        """Rebuilds for what the workers now serve and starts the loop again; with no
        ``infos`` (workers unreachable) keeps the scheduler and lets the loop reconnect."""
        if infos is None:
            self.scheduler.blocks.reset_cache()
        else:
            self._build(infos)
            await self.workers.open()
            self._set_healthy(True)
        self._task = asyncio.create_task(self._loop(), name="headrace-engine")

    def abort_in_flight(self) -> int:
        """Ends every request with a last FINISH_REASON_ABORTED response (drain, reload);
        returns how many requests were ended."""
        ended = 0
        for request in list(self.requests.values()):
            ended += 1
            for seq in request.sequences:
                if not seq.finished:
                    self._finish(seq, pb.FINISH_REASON_ABORTED)
            request.notify()
        self._wake.set()
        return ended

    def reconfigure(self, *, policy: Policy | None = None, max_running: int | None = None,
                    max_batched_tokens: int | None = None) -> None:
        """Live changes; they take effect from the next step."""
        if max_running is not None and max_running < 1:
            raise ValueError("max_running must be >= 1")
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if policy is not None:
            self.config.policy = self.scheduler.policy = policy
        if max_running is not None:
            self.config.max_running = self.scheduler.max_running = max_running
        if max_batched_tokens is not None:
            self.config.max_batched_tokens = self.scheduler.max_batched_tokens = max_batched_tokens

    def submit(self, request: Request) -> None:
        if request.stream_interval <= 0:
            request.stream_interval = self.config.stream_interval
        self.requests[request.request_id] = request
        self.telemetry.request_submitted(request)
        self.scheduler.add(request.sequences)
        self._wake.set()

    def abort(self, request: Request) -> None:
        """Client left (cancel, deadline): drop the request; its blocks are free at once."""
        for seq in request.sequences:
            if not seq.finished:
                self.scheduler.finish(seq, pb.FINISH_REASON_ABORTED)
                self.telemetry.seq_finished(seq, pb.FINISH_REASON_ABORTED)
        if self.requests.pop(request.request_id, None) is not None:
            self.telemetry.request_done(request)
        self._wake.set()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_all(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        await self.workers.close()

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for request in list(self.requests.values()):
            self.abort(request)
            request.fail(Failure(code, message))
        self.requests.clear()

    async def _loop(self) -> None:
        """Schedules and sends up to ``pipeline_depth`` steps before waiting for the oldest
        one's result (overlapped scheduling: the device computes step N+1 while this process
        handles step N's tokens); a step the workers may hold back (no ``flush``) is always
        followed by another, if need be an empty flushing one."""
        tel, clock = self.telemetry, time.perf_counter
        depth = max(1, self.config.pipeline_depth)
        inflight: collections.deque = collections.deque()   # (step, traced, sent at)
        last_flushed = True
        while True:
            if not self.healthy:
                self._wake_requests()
                inflight.clear()
                await self._reconnect()
                continue
            try:
                if len(inflight) < self._depth_now(depth):
                    t0 = clock()
                    step = self.scheduler.schedule()
                    if not step.empty:
                        msg = self._to_proto(step)
                        msg.flush = depth == 1
                        traced = tel.step_scheduled(step, msg, clock() - t0, msg.step_id)
                        await self.workers.send(msg)
                        last_flushed = msg.flush
                        self.scheduler.after_step(step)
                        inflight.append((step, traced, clock()))
                        continue
                self._wake_requests()   # after the send: the device is fed before clients are
                if not inflight:
                    tel.idle()
                    self._wake.clear()
                    if not self.scheduler.has_work:
                        await self._wake.wait()
                    else:  # waiting sequences that cannot be admitted yet and nothing runs
                        await asyncio.sleep(0.001)
                    continue
                if len(inflight) == 1 and not last_flushed:   # the worker holds it back: flush
                    await self.workers.send(wpb.StepRequest(step_id=next(self._step_ids), flush=True))
                    last_flushed = True
                    inflight.append((ScheduledStep(), None, clock()))
                step, traced, sent = inflight.popleft()
                result = await self.workers.receive()
            except WorkerError as exc:
                for _, traced, _ in inflight:
                    tel.step_failed(traced, exc)
                inflight.clear()
                log.error("worker group failed: %s; keeping %d requests for recompute",
                          exc, len(self.requests))
                self._set_healthy(False)
                self._outage_since = time.monotonic()
                self.scheduler.requeue_all()          # they resume by recompute when it is back
                self.scheduler.blocks.reset_cache()   # KV contents are gone with the worker
                continue
            t2 = clock()
            if traced is not None or not step.empty:
                emitted = self._process(step, result)
                tel.step_done(result, traced, t2 - sent, clock() - t2, emitted)

    def _depth_now(self, depth: int) -> int:
        """Steps allowed in flight. Two hide the device's step from this process's work; a
        third hides the gRPC round trip too, which decides latency at small batches. A finished
        sequence costs one slot per step sent before its last token came back, so beyond two
        only sequences whose end the worker can see itself may run: a sampled stop token
        (the worker then leaves them out of the steps it already holds) or max_tokens (never
        scheduled past). Stop strings match detokenized text here: while a sequence has some,
        two steps at most."""
        if depth <= 2 or not any(s.output.has_stop for s in self.scheduler.running):
            return depth
        return 2

    async def _reconnect(self) -> None:
        """Waits for the workers to come back; requests kept through the outage fail with
        UNAVAILABLE once it lasts longer than ``outage_deadline_s``."""
        try:
            await self.workers.describe(timeout=self.config.reconnect_interval_s * 5)
            await self.workers.open()
            self._set_healthy(True)
            self._outage_since = None
            log.info("worker group reconnected; resuming %d requests", len(self.requests))
        except WorkerError:
            since = self._outage_since
            if since is not None and time.monotonic() - since > self.config.outage_deadline_s:
                self.fail_all(grpc.StatusCode.UNAVAILABLE,
                              f"data plane unavailable for more than {self.config.outage_deadline_s:.0f}s")
                self._outage_since = None
            await asyncio.sleep(self.config.reconnect_interval_s)

    def _to_proto(self, step: ScheduledStep) -> wpb.StepRequest:
        msg = wpb.StepRequest(step_id=next(self._step_ids), finished_seq_ids=step.forget,
                              copy_src_blocks=[s for s, _ in step.copies],
                              copy_dst_blocks=[d for _, d in step.copies])
        tables = self.scheduler.blocks.tables
        for seq, n in step.new:
            msg.new_seqs.add(seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
                             output_token_ids=seq.output_token_ids,
                             block_ids=tables[seq.seq_id], num_computed_tokens=seq.num_computed,
                             num_scheduled_tokens=n, sampling=seq.sampling)
        for seq, n, new_blocks in step.running:
            msg.running_seq_ids.append(seq.seq_id)
            msg.running_num_scheduled.append(n)
            msg.running_new_block_counts.append(len(new_blocks))
            msg.running_new_block_ids.extend(new_blocks)
        return msg

    def _process(self, step: ScheduledStep, result: wpb.StepResult) -> int:
        """Folds a step's sampled tokens into its sequences; returns how many were kept."""
        by_seq = {s.seq_id: s for s, _ in step.scheduled()}
        top_pos, max_len, kept = 0, self.max_model_len, 0
        stopped = set(result.stopped_seq_ids)
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
            seq = by_seq.get(seq_id)
            k = seq.sampling.logprobs if seq is not None else 0
            if seq is None or seq.status is Status.FINISHED:
                top_pos += k
                continue  # finished or aborted while the step was in flight: wasted slot
            seq.num_inflight -= 1   # a preempted sequence keeps the token it was computing
            if not seq.output_token_ids:
                self.telemetry.first_token(seq)
            seq.output_token_ids.append(token)
            if k:
                seq.logprobs.append((result.logprobs[i], result.top_token_ids[top_pos:top_pos + k],
                                     result.top_logprobs[top_pos:top_pos + k]))
                top_pos += k
            kept += 1
            reason = seq.check_stop(seq_id in stopped, max_len)
            if reason != pb.FINISH_REASON_UNSPECIFIED:
                self._finish(seq, reason)
                self._to_wake.append(seq.request)
            elif len(seq.output_token_ids) - seq.delivered >= seq.request.stream_interval:
                self._to_wake.append(seq.request)   # woken once per stream_interval tokens
        return kept

    def _wake_requests(self) -> None:
        for request in self._to_wake:
            request.notify()
        self._to_wake.clear()

    def _finish(self, seq: Sequence, reason: int) -> None:
        self.scheduler.finish(seq, reason)
        self.telemetry.seq_finished(seq, reason)
        if seq.request.finished and self.requests.pop(seq.request_id, None) is not None:
            self.telemetry.request_done(seq.request)
