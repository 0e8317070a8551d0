"""A step's bitmask rows on the wire: ``TokenBitmask``'s shared form (worker.proto).

Why: one packed row of a 151,936-token vocabulary is 19 KB, and a step of 64 constrained rows
was 1.2 MB through gRPC: 1.25-1.34 ms round trip on this repository's 2-core machine against
0.4-0.5 ms for an empty step (``bench/mask_wire_bench.py``), on the critical path of every
constrained step (the worker samples when the bitmasks arrive). Rows of one schema in one
grammar state are equal (a batch of one JSON schema has a handful of distinct masks a step),
and a structural state (a key, a separator, EOS) allows a few tokens: the distinct masks are
sent once each, a sparse one as its allowed token ids. Sparse means under one in 16 of a row's
words (``LIST_BELOW_WORDS``: under 297 tokens of 151,936): listing costs ~0.03 ms plus ~0.1 µs a
nonzero word here, and spares ~2 µs a KB on the wire, so a 1,012-token mask (910 nonzero
words: 0.12 ms to list, 15 KB spared) crosses cheaper as its packed row.

``pack`` writes the shared form for a step whose plain rows reach ``SHARED_FROM_BYTES``
(128 KiB: 7 rows of a 151,936-token vocabulary); below that a message's size barely moves its
round trip (19 KB crossed as fast as an empty step, 300 KB took ~0.5 ms more) and packing
would cost about what it saves, so smaller steps keep the plain form (one row per entry)."""

from __future__ import annotations

import numpy as np
import xxhash

from headrace.worker.v1 import worker_pb2 as wpb

_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")   # numpy >= 2.0
SHARED_FROM_BYTES = 128 << 10
LIST_BELOW_WORDS = 16   # a mask allowing fewer than words / 16 tokens crosses as its token ids


def _allowed_counts(rows: np.ndarray) -> np.ndarray:
    """How many tokens each packed row allows."""
    if _HAS_BITWISE_COUNT:
        return np.bitwise_count(rows.view(np.uint32)).sum(axis=1, dtype=np.int64)
    return np.unpackbits(rows.view(np.uint8), axis=1).sum(axis=1, dtype=np.int64)


def _distinct(rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(index of each row's mask, the row that first holds each mask). Rows are grouped by
    an xxh3 digest of their bytes, and each is compared in full with its group's masks (a
    digest is no proof of equality: a row equal to none of them starts a mask of its own).
    One pass of hashing and one of comparing: 0.13-0.21 ms for 64 rows of a 151,936-token
    vocabulary on this repository's 2-core machine, where summing each row's words, gathering
    every row's group head and comparing them all took 0.46-0.52 ms."""
    mask_of = np.empty(len(rows), dtype=np.int64)
    firsts: list[int] = []
    heads: list[bytes | None] = []           # each mask's bytes, once a row is compared with it
    by_digest: dict[int, list[int]] = {}     # digest -> the masks that have it
    for i, row in enumerate(rows):
        candidates = by_digest.setdefault(xxhash.xxh3_64_intdigest(row), [])
        data = row.tobytes() if candidates else None
        for j in candidates:
            if heads[j] is None:
                heads[j] = rows[firsts[j]].tobytes()
            if heads[j] == data:
                mask_of[i] = j
                break
        else:
            mask_of[i] = len(firsts)
            candidates.append(len(firsts))
            firsts.append(i)
            heads.append(None)
    return mask_of, firsts


def _allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a packed row allows, ascending (only its nonzero words are unpacked)."""
    nonzero = np.flatnonzero(row)
    flags = np.unpackbits(row[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32)
    return (nonzero[:, None] * 32 + np.arange(32))[flags.astype(bool)]


def pack(rows: np.ndarray, out: wpb.TokenBitmask, shared_from: int = SHARED_FROM_BYTES) -> None:
    """Writes ``rows`` ([n, words] int32, one per entry of ``out.seq_ids``) into ``out``: the
    shared form when they are several and take ``shared_from`` bytes or more, else the plain
    form."""
    if len(rows) < 2 or rows.nbytes < shared_from:
        out.bits = rows.tobytes()
        return
    mask_of, first = _distinct(rows)
    masks = rows if len(first) == len(rows) else rows[first]
    counts = _allowed_counts(masks)
    listed = counts * LIST_BELOW_WORDS < rows.shape[1]
    counts[~listed] = -1
    out.mask_of.extend(mask_of.tolist())
    out.allowed_counts.extend(counts.tolist())
    out.bits = (masks[~listed] if listed.any() else masks).tobytes()
    if listed.any():
        out.allowed_ids = np.concatenate([_allowed_ids(masks[j]) for j in np.flatnonzero(listed)]
                                         ).astype("<u4").tobytes()
