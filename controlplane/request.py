"""A client request and its sequences (``n`` parallel samples of one prompt).

``Sequence`` is what the scheduler and the block manager see: tokens, KV progress, stop
rules and text. ``Request`` is what the client sees: one response stream (a queue) shared by
its sequences, which finishes when every sequence has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time

from controlplane.output import OutputText
from headrace.dataplane.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


class Status(enum.Enum):
    PENDING_FORK = 0   # a parallel sample waiting for its parent's prefill
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    n: int = 1
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    sequences: list["Sequence"] = dataclasses.field(default_factory=list)
    arrival: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclasses.dataclass(eq=False)
class Sequence:
    request: Request
    seq_id: int
    index: int
    prompt_token_ids: list[int]
    sampling: wpb.Sampling
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    output: OutputText
    priority: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    waiting_since: float = dataclasses.field(default_factory=time.monotonic)
    num_computed: int = 0           # tokens whose KV is in this sequence's blocks
    num_cached_prompt_tokens: int = 0
    on_worker: bool = False         # the workers hold this sequence in their mirror
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def check_stop(self, token_id: int, max_model_len: int) -> int:
        """Finish reason after ``token_id`` was appended (UNSPECIFIED to go on)."""
        n_out = len(self.output_token_ids)
        if n_out >= self.min_tokens and token_id in self.stop_token_ids:
            return pb.FINISH_REASON_STOP
        if self.output.add(token_id):
            return pb.FINISH_REASON_STOP_STRING
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_UNSPECIFIED
