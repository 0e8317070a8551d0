"""``--speculative-config``: the JSON object vLLM takes (``method``, ``num_speculative_tokens``,
``prompt_lookup_min`` / ``prompt_lookup_max`` for ``ngram``, ``model`` for ``draft_model``)
plus the back-off knobs, parsed and validated once. The worker is configured with it and
reports it in ``WorkerInfo.speculative``; the control plane schedules by that report."""

from __future__ import annotations

import dataclasses
import json

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str = ""
    disable_by_batch_size: int = 32   # no speculation while more decodes than this run
    min_acceptance: float = 0.15      # acceptance EWMA under which a sequence backs off


def parse(text: str | None) -> SpeculativeConfig | None:
    """The config of ``text`` (JSON; None or empty: speculation off). Raises ValueError with
    a message naming what is wrong."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {METHODS}, got {method!r}")
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError("--speculative-config: num_speculative_tokens must be an integer in [1, 16]")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5   # vLLM's default for ngram
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--speculative-config: {name} must be an integer >= 1")
    if lo > hi:
        raise ValueError("--speculative-config: prompt_lookup_min > prompt_lookup_max")
    model = raw.get("model") or ""
    if method == "draft_model" and not model:
        raise ValueError("--speculative-config: method draft_model needs a model")
    batch = raw.get("disable_by_batch_size", 32)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError("--speculative-config: disable_by_batch_size must be an integer >= 1")
    floor = raw.get("min_acceptance", 0.15)
    if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not 0 <= floor <= 1:
        raise ValueError("--speculative-config: min_acceptance must be a number in [0, 1]")
    return SpeculativeConfig(method, k, lo, hi, model, batch, float(floor))


def to_proto(config: SpeculativeConfig | None, message) -> None:
    """Fills ``message`` (a ``worker_pb2.Speculative``); left empty when ``config`` is None."""
    if config is not None:
        for f in dataclasses.fields(config):
            setattr(message, f.name, getattr(config, f.name))


def from_proto(message) -> SpeculativeConfig | None:
    if not message.method:
        return None
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(SpeculativeConfig)}
    values["min_acceptance"] = round(values["min_acceptance"], 6)   # a float32 on the wire
    return SpeculativeConfig(**values)
