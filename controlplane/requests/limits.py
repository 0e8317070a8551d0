"""Admission bounds derived from the model rather than fixed constants: the longest text a
prompt (or a Tokenize request, or a chat's messages) may be, the largest valid public request
in bytes (the gRPC receive limit and the HTTP body limit), the default queue bound, the cap
on ``n`` and the queue's refusal (``queue_refusal``: a request weighs its n samples times its
prompts, against the sequences already queued).

A prompt of ``max_model_len`` tokens is at most ``max_model_len * max_token_bytes`` bytes of
text (``ModelTokenizer.max_token_bytes``); ``TEXT_MARGIN`` covers what a normaliser drops. A
longer text is refused before it is tokenized: it could never fit.
"""

from __future__ import annotations

import json
import pathlib

import grpc

TEXT_MARGIN = 1.5
DEFAULT_CONTEXT = 131072     # when config.json names no context length
QUEUE_PER_SLOT = 4           # default --max-queued: this many waiting sequences per running slot
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS = 32     # prompts in one HTTP completions body (--max-prompts-per-request)
JSON_EXPANSION = 6           # a JSON string escapes a character in at most 6 bytes per UTF-8 byte
JSON_TOKEN_ID_BYTES = 12     # "4294967295, "
MAX_CONSTRAINT_BYTES = 2 << 20  # a structured-output schema or grammar (headrace.controlplane.structured.spec)
# everything but the prompt: stop strings (64 x 512), ids, sampling, a structured-output constraint
FIXED_REQUEST_BYTES = (1 << 20) + MAX_CONSTRAINT_BYTES


def max_text_bytes(max_model_len: int, max_token_bytes: int) -> int:
    return int(max_model_len * max_token_bytes * TEXT_MARGIN)


def text_too_long(name: str, text: str, limit: int) -> str | None:
    """The refusal of a text longer than ``limit`` UTF-8 bytes, or None (O(1) for most texts)."""
    if len(text) * 4 <= limit:
        return None
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return None
    return (f"{name} is longer than any prompt the model can take: at most {limit} bytes "
            "(max_model_len tokens of the tokenizer's longest token, with margin)")


def context_bound(model_dir: str, configured: int | None) -> int:
    """The most tokens a prompt can have on this model, known before the data plane answers:
    ``--max-model-len`` if set, else the checkpoint's context (config.json)."""
    if configured:
        return configured
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and value > 0 else DEFAULT_CONTEXT


def max_request_bytes(text_bytes: int, max_tokens: int) -> int:
    """The largest valid GenerateRequest / TokenizeRequest on the wire (protobuf): the prompt
    as text or as token ids (varints of at most 5 bytes), plus everything else."""
    return max(text_bytes, 5 * max_tokens) + FIXED_REQUEST_BYTES


def max_http_body_bytes(text_bytes: int, max_tokens: int) -> int:
    """The same request as a JSON body: escaped text, token ids as decimal numbers."""
    return max(JSON_EXPANSION * text_bytes, JSON_TOKEN_ID_BYTES * max_tokens) + FIXED_REQUEST_BYTES


def default_max_queued(max_running: int) -> int:
    return QUEUE_PER_SLOT * max_running


def queue_refusal(bound: int, queued: int, weight: int = 1) -> tuple[grpc.StatusCode, str] | None:
    """Why a request of ``weight`` sequences (n samples x prompts) cannot join ``queued``
    queued ones under the bound (0: unbounded): RESOURCE_EXHAUSTED while the queue is too full,
    INVALID_ARGUMENT when it could never fit; None when it fits."""
    if not bound or queued + weight <= bound:
        return None
    if weight > bound > 0:
        return (grpc.StatusCode.INVALID_ARGUMENT,
                f"n x prompts: {weight} sequences can never fit a queue of {bound} waiting "
                "sequences at most (the server's --max-queued)")
    return (grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"queue is full ({bound} waiting sequences at most, the server's --max-queued); retry later")
