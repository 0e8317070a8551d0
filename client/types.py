"""Typed requests and results of the client library: ``build_request`` turns keyword sampling
options into a ``GenerateRequest`` (unset options stay unset, so the server's defaults apply),
and the streamed responses become ``Chunk``s and, put together, ``Completion``s."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Sequence

from headrace.v1 import inference_pb2 as pb

# for generate(): one message with the whole completion (see GenerateRequest.stream_interval)
WHOLE_COMPLETION = 1 << 30


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int                  # the sampled token
    logprob: float                 # its log-probability
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob) of the top-k alternatives


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One streamed message: new tokens of sample ``index``; the last one of each sample has
    ``finish_reason`` (length, stop, stop_string, aborted) and ``usage``."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    tensor_parallel_size: int
    kv_block_size: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    num_host_kv_blocks: int = 0   # the host KV tier (--kv-offloading-size); 0: none


@dataclasses.dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    tokens: list[str]


def build_request(prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
                  temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, min_p: float | None = None,
                  repetition_penalty: float | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, seed: int | None = None,
                  logit_bias: dict[int, float] | None = None,
                  max_tokens: int | None = None, min_tokens: int | None = None,
                  stop: str | Iterable[str] | None = None,
                  stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                  priority: int | None = None, logprobs: int | None = None, n: int | None = None,
                  stream_interval: int | None = None, request_id: str | None = None,
                  json_schema: dict[str, Any] | str | None = None, regex: str | None = None,
                  choice: Sequence[str] | None = None, grammar: str | None = None,
                  json_object: bool = False, structured_backend: str | None = None,
                  model: str | None = None) -> pb.GenerateRequest:
    """A GenerateRequest of exactly the options given (None: the server's default);
    ``logit_bias``: token id -> bias added to its logit (OpenAI's, each in [-100, 100]).
    Structured outputs: at most one of ``json_schema`` (a dict or its JSON text), ``regex``,
    ``choice``, ``grammar`` (GBNF) or ``json_object``; ``structured_backend`` names the
    grammar engine the server must use (default: its own). ``model``: a LoRA adapter the
    server serves (default: the base model)."""
    if (prompt is None) == (token_ids is None):
        raise TypeError("give either a prompt or token_ids")
    req = pb.GenerateRequest(request_id=request_id or "", ignore_eos=ignore_eos, model=model or "")
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(token_ids)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("min_p", min_p), ("repetition_penalty", repetition_penalty),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("seed", seed)):
        if value is not None:
            setattr(req.sampling, name, value)
    for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens),
                        ("priority", priority), ("logprobs", logprobs), ("n", n),
                        ("stream_interval", stream_interval)):
        if value is not None:
            setattr(req, name, value)
    if stop is not None:
        req.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        req.stop_token_ids.extend(stop_token_ids)
    if logit_bias:
        req.sampling.logit_bias.update({int(t): float(b) for t, b in logit_bias.items()})
    constraint = structured_outputs(json_schema, regex, choice, grammar, json_object)
    if constraint is not None:
        req.structured.CopyFrom(constraint)
        req.structured.backend = structured_backend or ""
    return req


def structured_outputs(json_schema=None, regex=None, choice=None, grammar=None,
                       json_object: bool = False) -> pb.StructuredOutputs | None:
    """The ``StructuredOutputs`` of one constraint (None without any; TypeError for several)."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                                      ("grammar", grammar), ("json_object", json_object or None))
             if value is not None]
    if len(given) > 1:
        raise TypeError(f"give one structured-output constraint, not {', '.join(given)}")
    if not given:
        return None
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.StructuredOutputs(json_schema=text)
    if choice is not None:
        return pb.StructuredOutputs(choice=pb.ChoiceList(choices=list(choice)))
    if json_object:
        return pb.StructuredOutputs(json_object=True)
    return pb.StructuredOutputs(regex=regex) if regex is not None else pb.StructuredOutputs(grammar=grammar)


_REQUEST_PARAMETERS = ("prompt", "token_ids", "temperature", "top_p", "top_k", "min_p",
                       "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                       "logit_bias", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                       "ignore_eos", "priority", "logprobs", "n", "stream_interval", "request_id",
                       "json_schema", "regex", "choice", "grammar", "json_object", "structured_backend",
                       "model")


def request_from(arguments: dict) -> pb.GenerateRequest:
    """``build_request`` of a client method's own arguments (``locals()`` of ``generate`` or
    ``stream``, whose explicit keyword parameters are ``build_request``'s)."""
    return build_request(**{name: arguments[name] for name in _REQUEST_PARAMETERS})


def whole(req: pb.GenerateRequest) -> pb.GenerateRequest:
    """Asks for one message per sample when the caller did not choose a stream interval."""
    if not req.stream_interval:
        req.stream_interval = WHOLE_COMPLETION
    return req


def finish_reason_name(value: int) -> str | None:
    if not value:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def to_chunk(msg: pb.GenerateResponse) -> Chunk:
    logprobs = tuple(TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                     for lp in msg.logprobs)
    usage = None
    if msg.finish_reason:
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                      msg.usage.cached_prompt_tokens)
    return Chunk(msg.request_id, msg.index, msg.text, tuple(msg.token_ids), logprobs,
                 finish_reason_name(msg.finish_reason), usage)


class Collector:
    """Puts chunks together into one Completion per sample (by index)."""

    def __init__(self):
        self._parts: dict[int, list[Chunk]] = {}

    def add(self, chunk: Chunk) -> None:
        self._parts.setdefault(chunk.index, []).append(chunk)

    def completions(self) -> list[Completion]:
        out = []
        for index in sorted(self._parts):
            parts = self._parts[index]
            last = parts[-1]
            out.append(Completion(last.request_id, index, "".join(c.text for c in parts),
                                  [t for c in parts for t in c.token_ids], last.finish_reason,
                                  last.usage, [lp for c in parts for lp in c.logprobs]))
        return out

    def result(self, n: int | None):
        """One Completion when one sample was asked for, else the list in index order."""
        done = self.completions()
        return done if (n or 1) > 1 else done[0]


def to_model_info(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(msg.model_name, msg.architecture, msg.max_model_len, msg.vocab_size, msg.dtype,
                     msg.device, msg.tensor_parallel_size, msg.kv_block_size, msg.num_kv_blocks,
                     tuple(msg.eos_token_ids), msg.num_host_kv_blocks)
