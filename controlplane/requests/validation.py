"""Validates a ``GenerateRequest`` and turns it into a control-plane ``Request``.

Every problem raises ``ValidationError`` naming the field, before any work is done; the
service answers it with ``INVALID_ARGUMENT``. ``check_request`` makes every cheap check (the
text's size bound among them) so that the request path tokenizes only requests that can be
served; ``build_request`` then makes the ``Request`` from the prompt's ids.
"""

from __future__ import annotations

import math
import uuid

from headrace.controlplane.requests import limits
from headrace.controlplane.engine.deterministic import seed_sampling
from headrace.controlplane.requests.errors import ValidationError
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.requests.request import Request, Sequence
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.structured import spec
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb

MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024       # entries of a request's logit_bias
LOGIT_BIAS_RANGE = 100.0    # OpenAI's: each bias in [-100, 100]
MAX_REQUEST_ID_LEN = 256


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValidationError(message)


def _finite(name: str, value: float) -> None:
    _check(math.isfinite(value), f"{name} must be a finite number, got {value}")


def _in_vocab(name: str, ids, vocab_size: int) -> None:
    if not ids or max(ids) < vocab_size:   # (max is C; the search only on a refusal)
        return
    bad = next(t for t in ids if t >= vocab_size)
    _check(False, f"{name}: token id {bad} is out of vocabulary (size {vocab_size})")


def check_text(name: str, text: str, max_bytes: int) -> None:
    """A text to tokenize (a prompt, a Tokenize request) is at most ``max_bytes`` long."""
    problem = limits.text_too_long(name, text, max_bytes)
    _check(problem is None, problem or "")


def _sampling(s: pb.SamplingParams, vocab_size: int, checked: bool = False) -> wpb.Sampling:
    """The worker's sampling parameters, checked unless ``checked`` (``check_request`` did)."""
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    rep = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not checked:
        _check_sampling(s, temperature, top_p, rep)
        _check_logit_bias(s.logit_bias, vocab_size)
    return wpb.Sampling(temperature=temperature, top_p=top_p, top_k=min(s.top_k, vocab_size),
                        min_p=s.min_p, repetition_penalty=rep,
                        presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty, has_seed=s.HasField("seed"),
                        seed=s.seed, logit_bias=s.logit_bias)


def _check_logit_bias(bias, vocab_size: int) -> None:
    _check(len(bias) <= MAX_LOGIT_BIAS,
           f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    _in_vocab("sampling.logit_bias", list(bias), vocab_size)
    for token, value in bias.items():
        _check(math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE,
               f"sampling.logit_bias: the bias of token {token} must be in "
               f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value}")


def _check_sampling(s: pb.SamplingParams, temperature: float, top_p: float, rep: float) -> None:
    for name, v in (("sampling.temperature", temperature), ("sampling.top_p", top_p),
                    ("sampling.min_p", s.min_p), ("sampling.repetition_penalty", rep),
                    ("sampling.presence_penalty", s.presence_penalty),
                    ("sampling.frequency_penalty", s.frequency_penalty)):
        _finite(name, v)
    _check(temperature >= 0, f"sampling.temperature must be >= 0, got {temperature}")
    _check(0 < top_p <= 1, f"sampling.top_p must be in (0, 1], got {top_p}")
    _check(s.top_k >= 0, f"sampling.top_k must be >= 0 (0 disables it), got {s.top_k}")
    _check(0 <= s.min_p <= 1, f"sampling.min_p must be in [0, 1], got {s.min_p}")
    _check(rep > 0, f"sampling.repetition_penalty must be > 0, got {rep}")
    for name, v in (("presence_penalty", s.presence_penalty),
                    ("frequency_penalty", s.frequency_penalty)):
        _check(-2 <= v <= 2, f"sampling.{name} must be in [-2, 2], got {v}")


def token_prompt(req: pb.GenerateRequest, vocab_size: int, checked: bool = False) -> list[int]:
    """The ids of a ``prompt_token_ids`` request (``checked``: ``check_request`` passed)."""
    ids = list(req.prompt_token_ids.ids)
    if not checked:
        _check(len(ids) > 0, "prompt_token_ids must not be empty")
        _in_vocab("prompt_token_ids", ids, vocab_size)
    return ids


def check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt and the tokens asked for fit one sequence; the message names all three,
    since either the prompt or max_tokens may be the one to cut."""
    _check(prompt_tokens + max_tokens <= max_model_len,
           f"prompt {prompt_tokens} tokens + max_tokens {max_tokens} > max_model_len {max_model_len}: "
           f"shorten the prompt or lower max_tokens to at most {max(max_model_len - prompt_tokens, 0)}")


def check_request(req: pb.GenerateRequest, *, vocab_size: int, max_model_len: int,
                  max_n: int = limits.DEFAULT_MAX_N, max_text_bytes: int | None = None) -> None:
    """Every check that needs no tokenization (``max_text_bytes``: the prompt text's bound)."""
    rid = req.request_id
    _check(len(rid) <= MAX_REQUEST_ID_LEN, f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    _check(len(req.stop) <= MAX_STOP_STRINGS, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    _check(all(0 < len(s) <= MAX_STOP_LEN for s in req.stop),
           f"stop: each stop string must have 1 to {MAX_STOP_LEN} characters")
    _check(len(req.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
           f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
    _in_vocab("stop_token_ids", req.stop_token_ids, vocab_size)
    _check(0 <= req.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    _check(req.n <= max_n, f"n must be in [1, {max_n}] (the server's --max-n), got {req.n}")
    _check(req.min_tokens >= 0, f"min_tokens must be >= 0, got {req.min_tokens}")
    if req.HasField("max_tokens"):
        _check(req.max_tokens >= 1, f"max_tokens must be >= 1, got {req.max_tokens}")
    _sampling(req.sampling, vocab_size)
    if req.HasField("structured"):
        spec.from_proto(req.structured)
    kind = req.WhichOneof("input")
    _check(kind is not None, "prompt: set one of prompt, prompt_token_ids or messages")
    if kind == "prompt_token_ids":   # the prompt's length is known before any tokenization
        n = len(req.prompt_token_ids.ids)
        _check(n < max_model_len,
               f"prompt_token_ids has {n} tokens; max_model_len is {max_model_len}")
        if req.HasField("max_tokens"):
            check_fits(n, req.max_tokens, max_model_len)
        token_prompt(req, vocab_size)
    elif kind == "prompt":
        _check(req.prompt != "", "prompt must not be empty")
        if max_text_bytes is not None:
            check_text("prompt", req.prompt, max_text_bytes)


def build_request(req: pb.GenerateRequest, tokenizer: ModelTokenizer, *, seq_ids,
                  vocab_size: int, max_model_len: int, eos_token_ids: list[int],
                  ids: list[int] | None = None, max_n: int = limits.DEFAULT_MAX_N,
                  default_max_tokens: int | None = None, tenant: str = "",
                  checked: bool = False, deterministic: bool = False) -> Request:
    """A validated Request with its ``n`` sequences (ids drawn from the ``seq_ids`` iterator).
    ``ids``: the prompt's ids, tokenized (or rendered) by the caller; without them a
    ``prompt`` is tokenized here. ``default_max_tokens`` (the model's max_new_tokens) applies,
    capped by the room left, when max_tokens is unset. ``deterministic`` (the engine's mode):
    an unseeded request samples with ``headrace.controlplane.engine.deterministic.DEFAULT_SEED``. ``checked``: ``check_request`` passed."""
    if not checked:
        check_request(req, vocab_size=vocab_size, max_model_len=max_model_len, max_n=max_n)
    rid = req.request_id or uuid.uuid4().hex
    sampling = _sampling(req.sampling, vocab_size, checked)
    if deterministic:
        seed_sampling(sampling)
    if ids is None:
        kind = req.WhichOneof("input")
        _check(kind != "messages", "messages: chat is not available here")
        ids = token_prompt(req, vocab_size, checked) if kind == "prompt_token_ids" \
            else tokenizer.encode(req.prompt)
    _check(len(ids) > 0, "prompt tokenizes to no tokens" if req.WhichOneof("input") == "prompt"
           else "messages: the chat template rendered no tokens")
    _check(len(ids) < max_model_len,
           f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
           "(the KV pool and the model's context bound it; at least one output token must fit)")
    room = max_model_len - len(ids)
    max_tokens = req.max_tokens if req.HasField("max_tokens") else min(room, default_max_tokens or room)
    check_fits(len(ids), max_tokens, max_model_len)
    _check(req.min_tokens <= max_tokens, f"min_tokens {req.min_tokens} exceeds max_tokens {max_tokens}")
    stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
    sampling.logprobs = req.logprobs
    sampling.min_tokens = req.min_tokens
    sampling.stop_token_ids.extend(sorted(stop_ids))
    request = Request(request_id=rid, n=max(1, req.n), stream_interval=req.stream_interval,
                      tenant=tenant)
    if req.HasField("structured"):
        request.structured = spec.from_proto(req.structured)
    for index in range(request.n):
        seq_sampling = wpb.Sampling()
        seq_sampling.CopyFrom(sampling)
        if sampling.has_seed:   # each sample its own reproducible stream
            seq_sampling.seed = (sampling.seed + index) % (1 << 64)
        request.sequences.append(Sequence(
            request=request, seq_id=next(seq_ids), index=index, prompt_token_ids=ids,
            sampling=seq_sampling, max_tokens=max_tokens, priority=req.priority, arrival=request.arrival,
            output=OutputText(tokenizer.decode_stream(ids), list(req.stop))))
    return request
