"""The control plane's engine loop: schedule a step, send it to the workers, fold the sampled
tokens back into the requests and stream each request's new tokens and text to its client.

Runs as one asyncio task. Handlers talk to it through ``submit`` and ``abort``; results reach
handlers through each request's queue (a ``GenerateResponse``, or an ``EngineFailure``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging

import grpc

from controlplane.block_manager import BlockManager
from controlplane.request import Request, Status
from controlplane.scheduler import ScheduledStep, Scheduler
from controlplane.worker_client import WorkerError, WorkerGroup
from headrace.dataplane.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.engine")


@dataclasses.dataclass
class EngineConfig:
    max_running: int = 256
    max_batched_tokens: int = 8192
    max_model_len: int | None = None   # default: what the workers report (capped by the KV pool)
    reconnect_interval_s: float = 1.0


@dataclasses.dataclass
class EngineFailure:
    code: grpc.StatusCode
    message: str


class Engine:
    def __init__(self, workers: WorkerGroup, config: EngineConfig):
        self.workers = workers
        self.config = config
        self.info: wpb.WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0
        self.healthy = False
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self, timeout: float = 600.0) -> None:
        infos = await self.workers.describe(timeout)
        self.info = infos[0]
        blocks = BlockManager(self.workers.num_kv_blocks, self.info.block_size)
        # Every request must fit the KV pool alone, so preemption always makes progress.
        limit = min(self.info.max_model_len, blocks.num_blocks * blocks.block_size)
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        # Prompts are prefilled in one step, so one step must hold the longest prompt.
        budget = max(self.config.max_batched_tokens, self.max_model_len)
        self.scheduler = Scheduler(blocks, self.config.max_running, budget)
        await self.workers.open()
        self.healthy = True
        self._task = asyncio.create_task(self._loop(), name="headrace-engine")

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def submit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        self._wake.set()

    def abort(self, req: Request) -> None:
        """Client left (cancel, deadline): drop the request; its blocks are free at once."""
        if not req.finished:
            self.scheduler.finish(req, pb.FINISH_REASON_ABORTED)
        self.requests.pop(req.request_id, None)
        self._wake.set()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_all(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        await self.workers.close()

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for req in list(self.requests.values()):
            if not req.finished:
                self.scheduler.finish(req, pb.FINISH_REASON_ABORTED)
            req.queue.put_nowait(EngineFailure(code, message))
        self.requests.clear()

    async def _loop(self) -> None:
        while True:
            if not self.healthy:
                await self._reconnect()
                continue
            step = self.scheduler.schedule()
            if step.empty:
                self._wake.clear()
                if not self.scheduler.has_work:
                    await self._wake.wait()
                else:  # waiting requests that cannot be admitted yet; nothing runs
                    await asyncio.sleep(0.001)
                continue
            try:
                result = await self.workers.step(self._to_proto(step))
            except WorkerError as exc:
                log.error("worker group failed: %s", exc)
                self.healthy = False
                self.fail_all(grpc.StatusCode.UNAVAILABLE, f"data plane failed: {exc}")
                continue
            self.scheduler.after_step(step)
            self._process(step, result)

    async def _reconnect(self) -> None:
        try:
            await self.workers.describe(timeout=self.config.reconnect_interval_s * 5)
            await self.workers.open()
            self.healthy = True
            log.info("worker group reconnected")
        except WorkerError:
            await asyncio.sleep(self.config.reconnect_interval_s)

    def _to_proto(self, step: ScheduledStep) -> wpb.StepRequest:
        msg = wpb.StepRequest(step_id=next(self._step_ids), finished_seq_ids=step.forget)
        tables = self.scheduler.blocks.tables
        for req, n in step.new:
            msg.new_seqs.add(seq_id=req.seq_id, prompt_token_ids=req.prompt_token_ids,
                             output_token_ids=req.output_token_ids,
                             block_ids=tables[req.seq_id], num_computed_tokens=req.num_computed,
                             num_scheduled_tokens=n, sampling=req.sampling)
        for req, n, new_blocks in step.running:
            msg.running_seq_ids.append(req.seq_id)
            msg.running_num_scheduled.append(n)
            msg.running_new_block_counts.append(len(new_blocks))
            msg.running_new_block_ids.extend(new_blocks)
        return msg

    def _process(self, step: ScheduledStep, result: wpb.StepResult) -> None:
        by_seq = {r.seq_id: r for r, _ in step.scheduled()}
        top_pos = 0
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
            req = by_seq.get(seq_id)
            k = req.sampling.logprobs if req is not None else 0
            top = (result.top_token_ids[top_pos:top_pos + k], result.top_logprobs[top_pos:top_pos + k])
            top_pos += k
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step was in flight
            req.output_token_ids.append(token)
            reason = req.check_stop(token, self.max_model_len)
            msg = pb.GenerateResponse(request_id=req.request_id, token_ids=[token])
            if k:
                lp = msg.logprobs.add(token_id=token, logprob=result.logprobs[i])
                for tid, val in zip(*top):
                    lp.top.add(token_id=tid, logprob=val)
            if reason != pb.FINISH_REASON_UNSPECIFIED:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
                msg.finish_reason = reason
                msg.usage.prompt_tokens = len(req.prompt_token_ids)
                msg.usage.completion_tokens = len(req.output_token_ids)
            msg.text = req.output.delta(final=req.finished)
            req.queue.put_nowait(msg)
