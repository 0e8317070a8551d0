"""A client request and its sequences (``n`` parallel samples of one prompt).

``Sequence`` is what the scheduler and the block manager see: tokens, KV progress, stop
rules and text. ``Request`` is what the client sees: one response stream shared by its
sequences, which finishes when every sequence has.

The engine only appends sampled tokens and checks stop rules (stop tokens as the worker
reports them; stop strings and lengths here, detokenizing per token only for sequences with
stop strings), then wakes the request's handler; the handler builds one
response per sample from everything that arrived since its last one, so a client that falls
behind gets fewer, larger messages and the engine's per-token work stays small.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time

from headrace.controlplane.requests.output import OutputText
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb


class Status(enum.Enum):
    PENDING_FORK = 0   # a parallel sample waiting for its parent's prefill
    WAITING = 1
    RUNNING = 2
    FINISHED = 3
    GRAMMAR = 4        # its structured-output grammar compiles: not yet with the scheduler
    HELD = 5           # kept out of the scheduler while a failed step's sequences are tested
                       # apart (``headrace.controlplane.engine.step_failures``)


@dataclasses.dataclass
class Failure:
    """The request cannot go on (data plane lost, shutdown): its RPC ends with this status."""

    code: object   # grpc.StatusCode
    message: str


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    n: int = 1
    stream_interval: int = 0   # tokens per streamed message at least (0: the engine's default)
    tenant: str = ""           # the client it is served for (fair share: ``headrace.controlplane.scheduling.fairness``)
    structured: object = None  # its structured-output constraint (``headrace.controlplane.structured.spec``)
    lora_name: str = ""        # the LoRA adapter it asked for (``model``; "": the base model)
    sequences: list["Sequence"] = dataclasses.field(default_factory=list)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    failure: Failure | None = None
    _news: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    @property
    def delivered(self) -> bool:
        """Every sample's last response has been taken."""
        if self.n == 1:
            return self.sequences[0].final_sent
        return all(s.final_sent for s in self.sequences)

    def notify(self) -> None:
        if not self._news.is_set():
            self._news.set()

    def fail(self, failure: Failure) -> None:
        self.failure = failure
        self.notify()

    async def next_responses(self) -> list[pb.GenerateResponse]:
        """Waits for news; returns one response per sample that has any. Raises nothing:
        check ``failure`` first."""
        await self._news.wait()
        self._news.clear()
        return [m for m in (s.take_response() for s in self.sequences) if m is not None]


@dataclasses.dataclass(eq=False)
class Sequence:
    request: Request
    seq_id: int
    index: int
    prompt_token_ids: list[int]
    sampling: wpb.Sampling   # with the stop rule (stop_token_ids, min_tokens) the worker applies
    max_tokens: int
    output: OutputText
    priority: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    waiting_since: float = dataclasses.field(default_factory=time.monotonic)
    num_computed: int = 0           # tokens whose KV is in its blocks, or is being computed
    num_inflight: int = 0           # tokens sampled in steps whose results have not arrived
    num_cached_prompt_tokens: int = 0
    on_worker: bool = False         # the workers hold this sequence in their mirror
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    num_preemptions: int = 0
    logprobs: list = dataclasses.field(default_factory=list)   # (logprob, top ids, top values)
    delivered: int = 0        # output tokens already sent to the client
    text_fed: int = 0         # output tokens already turned into text
    final_sent: bool = False
    grammar: object = None    # its structured-output matcher (``headrace.controlplane.structured``)
    lora: object = None       # its LoRA adapter (``headrace.controlplane.lora.slots.Adapter``), or None

    @property
    def cache_root(self) -> int:
        """The root of its prompt blocks' hash chain: its adapter's (0: the base model's)."""
        return 0 if self.lora is None else self.lora.root

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
    def num_total(self) -> int:
        """Tokens known plus those sampled but not yet received."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_total - 1

    @property
    def may_sample_more(self) -> bool:
        """Another token may be scheduled: max_tokens and the context are not used up by the
        tokens known and in flight."""
        return len(self.output_token_ids) + self.num_inflight < self.max_tokens

    def check_stop(self, stopped: bool, max_model_len: int) -> int:
        """Finish reason after a token was appended (UNSPECIFIED to go on). ``stopped``: the
        worker found it a stop token (it alone applies ``sampling``'s stop rule: worker.proto)."""
        n_out = len(self.output_token_ids)
        if stopped:
            return pb.FINISH_REASON_STOP
        if self.output.has_stop and self._feed_text(n_out):
            return pb.FINISH_REASON_STOP_STRING
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_UNSPECIFIED

    def _feed_text(self, upto: int) -> bool:
        """Turns output tokens into text up to ``upto``; True when a stop string matched."""
        while self.text_fed < upto:
            token = self.output_token_ids[self.text_fed]
            self.text_fed += 1
            if self.output.add(token):
                return True
        return False

    def take_response(self) -> pb.GenerateResponse | None:
        """Everything new since the last response (None if nothing), the last one with the
        finish reason and usage. A stop token's own text is not returned."""
        n = len(self.output_token_ids)
        final = self.finished and not self.final_sent
        if self.delivered == n and not final:
            return None
        stopped_by_token = self.finished and self.finish_reason == pb.FINISH_REASON_STOP
        if not self.output.has_stop:
            self._feed_text(n - 1 if stopped_by_token else n)
        msg = pb.GenerateResponse(request_id=self.request.request_id, index=self.index,
                                  token_ids=self.output_token_ids[self.delivered:n])
        if self.logprobs:
            for token, (value, top_ids, top_values) in zip(msg.token_ids, self.logprobs[self.delivered:n]):
                lp = msg.logprobs.add(token_id=token, logprob=value)
                for tid, val in zip(top_ids, top_values):
                    lp.top.add(token_id=tid, logprob=val)
        self.delivered = n
        msg.text = self.output.delta(final=final)
        if final:
            self.final_sent = True
            msg.finish_reason = self.finish_reason
            msg.usage.prompt_tokens = len(self.prompt_token_ids)
            msg.usage.completion_tokens = n
            msg.usage.cached_prompt_tokens = self.num_cached_prompt_tokens
        return msg
