"""One front end's stream as the engine core holds it (``FrontendLink``): the requests it
submitted (``CoreRequest``, by the handle the front end chose) and the ``Down`` message being
built for it. ``headrace.controlplane.core.service`` says how the messages are batched."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

import grpc

from headrace.common import stage_times
from headrace.controlplane.core import load_publisher
from headrace.controlplane.requests.request import Request, Status
from headrace.core.v1 import core_pb2 as cpb

if TYPE_CHECKING:
    from headrace.controlplane.core.plane import EnginePlane


class CoreText:
    """Stands in for ``OutputText`` in the core: the front end detokenises and matches stop
    strings; ``has_stop`` only keeps the pipeline at two steps (``InFlightSteps.has_room``)."""

    def __init__(self, has_stop: bool):
        self.has_stop = has_stop

    def add(self, token_id: int) -> bool:
        return False


@dataclasses.dataclass(eq=False)
class CoreRequest(Request):
    link: "FrontendLink | None" = None
    handle: int = 0
    span: object = None

    def notify(self) -> None:
        self.link.mark(self)


def num_queued(plane) -> int:
    """The engine's queued sequences (what ``--max-queued`` bounds); 0 before a model."""
    sched = plane.engine.scheduler
    return sched.num_queued if sched is not None else 0


def _columns() -> tuple[list[int], list[int], list[int], list[int]]:
    """Empty ``Down`` token columns: handles, sample indexes, counts, token ids."""
    return [], [], [], []


class FrontendLink:
    """One front end's stream: its requests by handle and the ``Down`` message being built."""

    def __init__(self, plane: "EnginePlane"):
        self.plane = plane   # the engine core's (its engine changes on a model reload)
        self.index = -1
        self.requests: dict[int, CoreRequest] = {}
        self._dirty: dict[CoreRequest, None] = {}
        self._pending = cpb.Down()
        self._columns = _columns()   # the pending message's token columns, as lists
        self._ready = asyncio.Event()
        self._flush_scheduled = False
        self.closed = False
        self.placement = False   # the front end places requests: it gets ``Down.load``
        self.sent_queued = -1   # the queue length this front end was last told

    def mark(self, request: CoreRequest) -> None:
        self._dirty[request] = None
        if not self._flush_scheduled:   # once all of this step's wake-ups are in
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_marked)

    def _flush_marked(self) -> None:
        if self._flush_scheduled:   # (not flushed meanwhile: ``EngineCoreService.flush``)
            self.flush()

    def fail(self, handle: int, code: grpc.StatusCode, message: str) -> None:
        self._pending.failed.add(handle=handle, code=code.value[0], message=message)
        self._ready.set()

    def push_state(self, state: cpb.CoreState) -> None:
        self._pending.state.CopyFrom(state)
        self._ready.set()

    def push_load(self, load: cpb.CoreLoad) -> None:
        if self._pending.HasField("load"):
            load_publisher.merge(self._pending.load, load)
        else:
            self._pending.load.CopyFrom(load)
        self._ready.set()

    def flush(self) -> None:
        """Appends the new tokens of every request woken since the last flush."""
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, {}
        if self.closed:
            return
        deltas, done = self._pending.deltas, []
        handles, indexes, counts, tokens = self._columns
        stages = stage_times.STAGES
        for req in dirty:
            if stages is not None and req.sequences[0].delivered == 0:   # its first tokens
                stages.stamp(req.request_id, "core_flushed")
            if req.failure is not None:
                self.fail(req.handle, req.failure.code, req.failure.message)
                done.append(req)
                continue
            over = True   # every sample finished (each then gets its last delta below)
            for seq in req.sequences:
                out, start = seq.output_token_ids, seq.delivered
                n, running = len(out), seq.status is not Status.FINISHED
                if running:
                    over = False
                    if start == n:
                        continue
                    if not seq.logprobs:   # the common case: a column entry
                        handles.append(req.handle)
                        indexes.append(seq.index)
                        counts.append(n - start)
                        tokens += out[start:n]
                        seq.delivered = n
                        continue
                elif seq.final_sent:
                    continue
                d = deltas.add(handle=req.handle, index=seq.index, token_ids=out[start:n])
                if seq.logprobs:
                    for token, (value, top_ids, top_values) in zip(d.token_ids, seq.logprobs[start:n]):
                        lp = d.logprobs.add(token_id=token, logprob=value)
                        for tid, val in zip(top_ids, top_values):
                            lp.top.add(token_id=tid, logprob=val)
                seq.delivered = n
                if not running:
                    seq.final_sent = True
                    d.finish_reason = seq.finish_reason
                    d.cached_prompt_tokens = seq.num_cached_prompt_tokens
            if over:
                done.append(req)
        for req in done:
            self.forget(req)
        self._ready.set()

    def forget(self, req: CoreRequest) -> None:
        if self.requests.pop(req.handle, None) is not None and req.span is not None:
            req.span.end()

    async def next_message(self) -> cpb.Down:
        """Everything pending, as one message (waits for something to send)."""
        await self._ready.wait()
        self._ready.clear()
        msg, self._pending = self._pending, cpb.Down()
        (handles, indexes, counts, tokens), self._columns = self._columns, _columns()
        if handles:
            msg.token_handles.extend(handles)
            msg.token_indexes.extend(indexes)
            msg.token_counts.extend(counts)
            msg.token_ids.extend(tokens)
        msg.num_waiting = self.sent_queued = num_queued(self.plane)
        return msg

    def note_queue(self, queued: int) -> None:
        """Sends the queue length (``queued``) if this front end does not know it yet."""
        if queued != self.sent_queued:
            self._ready.set()

    def close(self) -> int:
        """The front end is gone: aborts its requests (their blocks are free at once)."""
        self.closed = True
        engine, requests = self.plane.engine, list(self.requests.values())
        for req in requests:
            engine.abort(req)
            self.forget(req)
        return len(requests)
