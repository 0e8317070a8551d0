"""Turns the logits of the sequences that sample in a step into token ids (and logprobs).

Greedy when temperature is 0; otherwise penalties, temperature, top-k, top-p and min-p, then
an exponential race (argmax of p / Exp(1) noise), which samples from p. All of it is batched
tensor work on the logits' device; the filters run only when some row asks for them. A
seeded sequence draws its noise from a counter-based hash of (seed, output index, token id),
so its tokens depend on nothing but its own seed and history: not on its batch neighbours,
and not on preemption and resumption.
"""

from __future__ import annotations

import dataclasses

import torch

_MASK = float("-inf")
# splitmix64 constants as signed 64-bit integers (torch has no uint64 arithmetic)
_GOLDEN = -7046029254386353131      # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687        # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685        # 0x94D049BB133111EB


@dataclasses.dataclass
class SamplingRow:
    """One sampling sequence's parameters and history (token ids as Python lists)."""

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
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0
                or (bool(self.suppress_token_ids) and len(self.output_token_ids) < self.min_tokens))


@dataclasses.dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None          # sampled tokens' logprobs, when any row asked
    top_token_ids: list[list[int]] | None  # per row, its `logprobs` best tokens
    top_logprobs: list[list[float]] | None


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        if not r.has_penalty:
            continue
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


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p where any row asks for them."""
    dev = logits.device
    logits = logits / torch.tensor([r.temperature for r in rows], device=dev)[:, None]
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        top_k = torch.tensor([r.top_k for r in rows], device=dev)
        top_p = torch.tensor([r.top_p for r in rows], device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), _MASK)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        sorted_logits = sorted_logits.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], _MASK)
        logits = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)
    if any(r.min_p > 0 for r in rows):
        min_p = torch.tensor([r.min_p for r in rows], device=dev)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.max(-1, keepdim=True).values * min_p[:, None], _MASK)
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


def _signed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _noise(rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
    q = torch.empty(len(rows), vocab, device=device).exponential_()
    seeded = [i for i, r in enumerate(rows) if r.seed is not None]
    if seeded:
        seeds = torch.tensor([_signed(rows[i].seed) for i in seeded], device=device)
        counters = torch.tensor([len(rows[i].output_token_ids) for i in seeded], device=device)
        q[seeded] = hashed_exponential(seeds, counters, vocab)
    return q


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """logits: [len(rows), vocab] float32 (modified in place)."""
    want = max((r.logprobs for r in rows), default=0)
    raw = logits.log_softmax(-1) if want else None
    if any(r.has_penalty for r in rows):
        _apply_penalties(logits, rows)
    random_idx = [i for i, r in enumerate(rows) if r.temperature > 0]
    if not random_idx:
        tokens = logits.argmax(-1)
    elif len(random_idx) == len(rows):
        probs = _filter(logits, rows).softmax(-1)
        tokens = (probs / _noise(rows, logits.shape[1], logits.device)).argmax(-1)
    else:
        tokens = logits.argmax(-1)
        sub = [rows[i] for i in random_idx]
        idx = torch.tensor(random_idx, device=logits.device)
        probs = _filter(logits[idx], sub).softmax(-1)
        tokens[idx] = (probs / _noise(sub, logits.shape[1], logits.device)).argmax(-1)
    token_list = tokens.tolist()
    if raw is None:
        return SampleOutput(token_list, None, None, None)
    sampled = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
    top_vals, top_ids = raw.topk(want, dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return SampleOutput(
        token_list, sampled,
        [top_ids[i][:r.logprobs] for i, r in enumerate(rows)],
        [top_vals[i][:r.logprobs] for i, r in enumerate(rows)],
    )
