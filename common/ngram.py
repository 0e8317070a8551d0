"""The n-gram (prompt lookup) proposer of speculative decoding, shared by both planes: the data
plane proposes a sequence's drafts with it, and the control plane proposes the same drafts for
a structured-output sequence so that it can check them against the sequence's grammar (and
compute each position's token bitmask) before the step goes out. numpy only (no torch)."""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, lo: int, hi: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest suffix of
    ``tokens`` of ``hi`` .. ``lo`` tokens (empty when none occurs). One pass over the tokens
    finds where the last token occurred before; only those places are extended backwards."""
    n_tok = len(tokens)
    hi = min(hi, n_tok - 1)
    if hi < lo:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:n_tok - 1] == tokens[n_tok - 1])   # each is followed by a token
    length = np.ones(len(ends), np.int64)   # how much of the suffix ends at each of them
    alive = np.ones(len(ends), bool)
    for j in range(1, hi):
        if not alive.any():
            break
        prev = ends - j
        alive &= prev >= 0
        alive[alive] = tokens[prev[alive]] == tokens[n_tok - 1 - j]
        length += alive
    for n in range(hi, lo - 1, -1):
        hits = ends[length >= n]
        if len(hits):   # the earliest end is the earliest start of an n-token match
            start = int(hits[0]) + 1
            return tokens[start:start + k]
    return tokens[:0]
