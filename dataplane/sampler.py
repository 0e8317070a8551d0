"""Turns the logits of the sequences that sample in a step into token ids (and logprobs).

Greedy when temperature is 0; otherwise penalties, temperature, top-k, top-p and min-p, then
an exponential race (argmax of p / Exp(1) noise), which samples from p. The per-row
parameters arrive as numpy arrays (``SamplingBatch``) and all of the work is batched tensor
work on the logits' device, with no host synchronisation until the ids are read; the filters
and penalties run only when some row asks for them. A seeded sequence draws its noise from a
counter-based hash of (seed, output index, token id), so its tokens depend on nothing but its
own seed and history: not on its batch neighbours, and not on preemption and resumption.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

_MASK = float("-inf")
# splitmix64 constants as signed 64-bit integers (torch has no uint64 arithmetic)
_GOLDEN = -7046029254386353131      # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687        # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685        # 0x94D049BB133111EB


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
    suppress_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def uses_history(self) -> bool:
        """Penalties need the token history; rows without them keep none."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or (bool(self.suppress_token_ids) and self.min_tokens > 0))


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
    """Sampled ids (and logprobs when asked) as device tensors; ``to_host`` reads them."""

    token_ids: torch.Tensor                # [rows] int64
    logprobs: torch.Tensor | None          # [rows] sampled tokens' logprobs
    top_ids: torch.Tensor | None           # [rows, k_max]
    top_values: torch.Tensor | None
    ks: list[int]                          # logprobs wanted per row

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                               list[list[float]] | None]:
        tokens = self.token_ids.tolist()
        if self.logprobs is None:
            return tokens, None, None, None
        ids, vals = self.top_ids.tolist(), self.top_values.tolist()
        return (tokens, self.logprobs.tolist(), [ids[i][:k] for i, k in enumerate(self.ks)],
                [vals[i][:k] for i, k in enumerate(self.ks)])


def signed_seed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _apply_penalties(logits: torch.Tensor, penalized: list[tuple[int, SamplingRow]]) -> None:
    for i, r in penalized:
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
        if r.suppress_token_ids and len(r.output_token_ids) < r.min_tokens:
            logits[i, r.suppress_token_ids] = _MASK


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device, non_blocking=True)


def _filter(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p where any row asks for them."""
    dev = logits.device
    temp = np.where(b.temperature > 0, b.temperature, 1.0).astype(np.float32)
    logits = logits / _dev(temp, dev)[:, None]
    if (b.top_k > 0).any() or (b.top_p < 1.0).any():
        top_k, top_p = _dev(b.top_k, dev), _dev(b.top_p, dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), _MASK)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        sorted_logits = sorted_logits.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], _MASK)
        logits = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)
    if (b.min_p > 0).any():
        probs = logits.softmax(-1)
        cut = probs.max(-1, keepdim=True).values * _dev(b.min_p, dev)[:, None]
        logits = logits.masked_fill(probs < cut, _MASK)
    return logits


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hashed_exponential(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] from splitmix64 of (seed, counter, token id): reproducible on
    a given device whatever else is in the batch."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds[:, None] * _GOLDEN) ^ (counters[:, None] * _MIX2) ^ v[None, :]
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    x = x ^ _srl(x, 31)
    u = (_srl(x, 11).double() + 0.5) / float(1 << 53)
    return (-u.log()).float()


def sample(logits: torch.Tensor, b: SamplingBatch) -> SampleOutput:
    """logits: [rows, vocab] float32 (modified in place)."""
    dev = logits.device
    want = int(b.logprobs.max()) if len(b.logprobs) else 0
    raw = logits.log_softmax(-1) if want else None
    if b.penalized:
        _apply_penalties(logits, b.penalized)
    greedy = b.temperature <= 0
    if greedy.all():
        tokens = logits.argmax(-1)
    else:
        probs = _filter(logits, b).softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        if b.has_seed.any():
            idx = np.flatnonzero(b.has_seed)
            noise[_dev(idx, dev)] = hashed_exponential(_dev(b.seed[idx], dev), _dev(b.num_output[idx], dev),
                                                       logits.shape[1])
        tokens = (probs / noise).argmax(-1)
        if greedy.any():
            tokens = torch.where(_dev(greedy, dev), logits.argmax(-1), tokens)
    if raw is None:
        return SampleOutput(tokens, None, None, None, [])
    top_vals, top_ids = raw.topk(want, dim=-1)
    return SampleOutput(tokens, raw.gather(1, tokens[:, None]).squeeze(1), top_ids, top_vals,
                        b.logprobs.tolist())
