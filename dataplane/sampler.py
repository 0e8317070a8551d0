"""Turns the logits of the sequences that sample in a step into token ids (and logprobs).

Greedy when temperature is 0; otherwise penalties, temperature, top-k, top-p and min-p, then
an exponential race (argmax of logits / t - log E with E ~ Exp(1)), which samples from the
softmax without computing it: ``kernels.sample_race``, one pass over the logits on a GPU. The
per-row parameters arrive as numpy arrays (``SamplingBatch``); ``device_arrays`` names what
the device needs, which the runner uploads with the step's other inputs in one copy, so
sampling never waits on the host. The filters and penalties run only when some row asks for
them. The race's noise is a counter-based hash of (seed, output index, token id): a seeded
sequence's tokens depend on nothing but its own seed and history (not on its batch neighbours,
nor on preemption and resumption); unseeded rows get fresh random seeds every step (on a CPU,
where hashing costs more than the model, torch's exponential noise instead). Rows a grammar
constrains (structured outputs) have their forbidden tokens set to -inf first, on the device
(``kernels.apply_token_bitmask``, from the ``mask_bits`` / ``mask_rows`` arrays; a step's
masks shared by several rows come once each, and ``mask_of`` names each row's). Then a row's
logit bias is added and its penalties applied, row by row (``_apply_penalties``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from headrace import kernels
from headrace.common import failpoints
from headrace.dataplane import staging

_MASK = float("-inf")


@dataclasses.dataclass
class SamplingRow:
    """One sequence's sampling parameters and history (token ids as Python lists)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    logprobs: int
    min_tokens: int
    stop_token_ids: list[int]   # masked while fewer than min_tokens outputs exist
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # token ids and the biases added to their logits before everything else (OpenAI's logit_bias)
    bias_ids: list[int] = dataclasses.field(default_factory=list)
    bias_values: list[float] = dataclasses.field(default_factory=list)
    _bias: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, float32 biases) on ``device``, made at the row's first biased step and kept:
        a bias never changes, so later steps copy nothing to the device for it."""
        if self._bias is None or self._bias[0].device != device:
            self._bias = (torch.tensor(self.bias_ids, dtype=torch.long, device=device),
                          torch.tensor(self.bias_values, dtype=torch.float32, device=device))
        return self._bias

    @property
    def uses_history(self) -> bool:
        """Rows the sampler edits one by one (``_apply_penalties``): penalties, which need the
        token history (rows without them keep none), min_tokens' stop mask and a logit bias.
        Such rows sample eagerly and do not speculate."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or (bool(self.stop_token_ids) and self.min_tokens > 0)
                or bool(self.bias_ids))


@dataclasses.dataclass
class SamplingBatch:
    """Parameters of the rows that sample in a step, one array entry per row."""

    temperature: np.ndarray   # float32
    top_k: np.ndarray         # int64, 0 = off
    top_p: np.ndarray         # float32
    min_p: np.ndarray         # float32
    seed: np.ndarray          # int64 (signed view of the uint64 seed)
    has_seed: np.ndarray      # bool
    num_output: np.ndarray    # int64: tokens generated so far (the seeded noise counter)
    logprobs: np.ndarray      # int64
    penalized: list[tuple[int, SamplingRow]]   # (index, row) of rows with penalties

    @classmethod
    def of_rows(cls, rows: list[SamplingRow]) -> "SamplingBatch":
        return cls(np.array([r.temperature for r in rows], np.float32),
                   np.array([r.top_k for r in rows], np.int64),
                   np.array([r.top_p for r in rows], np.float32),
                   np.array([r.min_p for r in rows], np.float32),
                   np.array([signed_seed(r.seed or 0) for r in rows], np.int64),
                   np.array([r.seed is not None for r in rows], bool),
                   np.array([len(r.output_token_ids) for r in rows], np.int64),
                   np.array([r.logprobs for r in rows], np.int64),
                   [(i, r) for i, r in enumerate(rows) if r.uses_history])


@dataclasses.dataclass
class SampleOutput:
    """Sampled ids (and logprobs when asked) as device tensors; ``start_download`` queues their
    copy to pinned host memory, ``to_host`` reads them (after the step's event, on a GPU)."""

    token_ids: torch.Tensor                # [rows] int64
    logprobs: torch.Tensor | None          # [rows] sampled tokens' logprobs
    top_ids: torch.Tensor | None           # [rows, k_max]
    top_values: torch.Tensor | None
    ks: list[int]                          # logprobs wanted per row
    _host: list | None = None

    def start_download(self) -> None:
        self._host = [None if t is None else staging.download(t)
                      for t in (self.token_ids, self.logprobs, self.top_ids, self.top_values)]

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                               list[list[float]] | None]:
        tok, logprobs, top_ids, top_values = self._host or (
            self.token_ids, self.logprobs, self.top_ids, self.top_values)
        tokens = tok.tolist()
        if logprobs is None:
            return tokens, None, None, None
        ids, vals = top_ids.tolist(), top_values.tolist()
        return (tokens, logprobs.tolist(), [ids[i][:k] for i, k in enumerate(self.ks)],
                [vals[i][:k] for i, k in enumerate(self.ks)])


def with_default_seed(b: SamplingBatch, seed: int) -> SamplingBatch:
    """``b`` with its unseeded rows seeded with ``seed`` (``--deterministic``: no row draws
    fresh noise, so a request's samples depend on its own parameters only; the control plane
    seeds every request in that mode, this covers one that does not)."""
    return dataclasses.replace(b, seed=np.where(b.has_seed, b.seed, np.int64(signed_seed(seed))),
                               has_seed=np.ones_like(b.has_seed))


def signed_seed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _apply_penalties(logits: torch.Tensor, penalized: list[tuple[int, SamplingRow]]) -> None:
    for i, r in penalized:
        if r.bias_ids:   # first, as vLLM does: the penalties and filters see the biased logits
            ids, values = r.bias_tensors(logits.device)
            logits[i, ids] += values.to(logits.dtype)
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / r.repetition_penalty,
                                          vals * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0)
        if r.stop_token_ids and len(r.output_token_ids) < r.min_tokens:
            logits[i, r.stop_token_ids] = _MASK


def _filters(b: SamplingBatch) -> tuple[bool, bool, bool]:
    return bool((b.top_k > 0).any()), bool((b.top_p < 1.0).any()), bool((b.min_p > 0).any())


def device_arrays(b: SamplingBatch, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What ``sample`` reads on the device, as host arrays (uploaded by the caller)."""
    greedy = b.temperature <= 0
    top_k, top_p, min_p = _filters(b)
    filtered = top_k or top_p or min_p
    random_seeds = rng.integers(-(1 << 63), (1 << 63) - 1, size=len(b.seed), dtype=np.int64)
    arrays = {
        # the race divides by this: the filters already divided by the temperature
        "race_temp": np.where(greedy, 0.0, 1.0 if filtered else b.temperature).astype(np.float32),
        "seeds": np.where(b.has_seed, b.seed, random_seeds),
        "counters": b.num_output.astype(np.int64),
    }
    if filtered:
        arrays["temp"] = np.where(greedy, 1.0, b.temperature).astype(np.float32)
    if top_k or top_p:
        arrays["top_k"], arrays["top_p"] = b.top_k, b.top_p
    if min_p:
        arrays["min_p"] = b.min_p
    return arrays


def apply_filters(logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p where any row asks for them."""
    logits = logits / dev["temp"][:, None]
    if "top_k" in dev:
        top_k, top_p = dev["top_k"], dev["top_p"]
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)   # ties: by id
        ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), _MASK)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        sorted_logits = sorted_logits.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], _MASK)
        logits = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)
    if "min_p" in dev:
        probs = logits.softmax(-1)
        cut = probs.max(-1, keepdim=True).values * dev["min_p"][:, None]
        logits = logits.masked_fill(probs < cut, _MASK)
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch, dev: dict[str, torch.Tensor] | None = None,
           rng: np.random.Generator | None = None) -> SampleOutput:
    """logits: [rows, vocab] in the model's dtype; ``dev``: ``device_arrays`` on the logits'
    device (uploaded here from ``rng``'s seeds when not given)."""
    if failpoints.ACTIVE:   # (tests: a request whose sampling raises, by its seed)
        failpoints.hit("dataplane.sampler", seed=b.seed[b.has_seed].tolist())
    if dev is None:
        dev = staging.upload(device_arrays(b, rng or np.random.default_rng()), logits.device)
    want = int(b.logprobs.max()) if len(b.logprobs) else 0
    raw = logits.float().log_softmax(-1) if want else None
    if "mask_bits" in dev:   # structured outputs: the grammar's tokens only (logprobs: the model's)
        kernels.apply_token_bitmask(logits, dev["mask_bits"], dev["mask_rows"], dev.get("mask_of"))
    if b.penalized:
        logits = logits.float()   # penalties write in place (a graph output is rewritten next step)
        _apply_penalties(logits, b.penalized)
    if "temp" in dev:
        logits = apply_filters(logits.float(), dev)
    if logits.is_cuda:
        tokens = kernels.sample_race(logits, dev["race_temp"], dev["seeds"], dev["counters"])
    elif not (b.temperature > 0).any():   # greedy rows only: no noise to draw
        tokens = logits.argmax(-1)
    elif kernels.batch_invariant.ENABLED:   # every row seeded; logs vectorized wherever it sits
        noise = kernels.reference_invariant.race_noise(dev["seeds"], dev["counters"], logits.shape[1])
        tokens = kernels.reference_invariant.race(logits, dev["race_temp"], noise)
    else:   # the hash costs ~10 integer passes over the logits on a CPU: only seeded rows pay it
        noise = torch.empty(logits.shape, dtype=torch.float32).exponential_()
        if b.has_seed.any():
            idx = torch.from_numpy(np.flatnonzero(b.has_seed))
            noise[idx] = kernels.reference.race_noise(dev["seeds"][idx], dev["counters"][idx],
                                                      logits.shape[1])
        tokens = kernels.reference.race(logits, dev["race_temp"], noise)
    if raw is None:
        return SampleOutput(tokens, None, None, None, [])
    top_vals, top_ids = raw.topk(want, dim=-1)
    return SampleOutput(tokens, raw.gather(1, tokens[:, None]).squeeze(1), top_ids, top_vals,
                        b.logprobs.tolist())
