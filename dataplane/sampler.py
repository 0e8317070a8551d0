"""Turns the logits of the sequences that sample in a step into token ids (and logprobs).

Greedy when temperature is 0; otherwise penalties, temperature, top-k, top-p and min-p, then
an exponential race (argmax of p / Exp(1) noise), which samples from p. A seeded sequence draws
its noise from a generator seeded by (seed, output index), so its tokens depend on nothing but
its own seed and history: not on its batch neighbours, and not on preemption and resumption.
"""

from __future__ import annotations

import dataclasses

import torch

_MASK = float("-inf")


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


@dataclasses.dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None          # sampled tokens' logprobs, when any row asked
    top_token_ids: list[list[int]] | None  # per row, its `logprobs` best tokens
    top_logprobs: list[list[float]] | None


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            if seen.numel():
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
    """Temperature, top-k, top-p and min-p, applied to the rows that sample randomly."""
    dev = logits.device
    temp = torch.tensor([r.temperature for r in rows], device=dev)
    logits = logits / temp[:, None]
    top_k = torch.tensor([r.top_k for r in rows], device=dev)
    top_p = torch.tensor([r.top_p for r in rows], device=dev)
    if (top_k > 0).any() or (top_p < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        logits = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)
    min_p = torch.tensor([r.min_p for r in rows], device=dev)
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        cut = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < cut, _MASK)
    return logits


def _noise(rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
    q = torch.empty(len(rows), vocab, device=device).exponential_()
    for i, r in enumerate(rows):
        if r.seed is not None:
            g = torch.Generator(device=device)
            g.manual_seed((r.seed * 1_000_003 + len(r.output_token_ids)) % (2**63))
            q[i].exponential_(generator=g)
    return q


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """logits: [len(rows), vocab] float32 (modified in place)."""
    want = max((r.logprobs for r in rows), default=0)
    raw = logits.log_softmax(-1) if want else None
    _apply_penalties(logits, rows)
    tokens = logits.argmax(-1)
    random_idx = [i for i, r in enumerate(rows) if r.temperature > 0]
    if random_idx:
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
