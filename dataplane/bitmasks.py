"""Structured outputs on the worker: a step's ``TokenBitmask`` (one packed row per constrained
sequence, as the control plane computed it from the sequence's grammar; one per verified
position for a sequence verifying checked drafts) becomes the arrays the sampler applies on the
device: ``s_mask_bits`` [masks, words] int32, ``s_mask_rows`` (each bitmask row's index among
the step's sampling rows) and, in the shared form, ``s_mask_of`` (each bitmask row's mask; the
sampler gathers the rows on the device). Sequences the step does not sample (left out because
they stopped) are skipped; a malformed message is a ``BatchError``. The plain form's rows are
read where the message holds them (a read-only view; the upload to the device is their one
copy); the shared form (each distinct mask once, a sparse one as its allowed token ids) is
unpacked mask by mask and uploaded so: 64 rows of a 151,936-token vocabulary in a handful of
states move a few 19 KB masks to the device, not 1.2 MB expanded on the host first.
``checked_drafts`` reads the drafts the control plane checked against the grammars
(``StepRequest.checked_drafts``)."""

from __future__ import annotations

import numpy as np

from headrace.dataplane.input_batch import BatchError
from headrace.worker.v1 import worker_pb2 as pb


def arrays(bitmask: pb.TokenBitmask, sample_seq_ids: np.ndarray, num_drafts: np.ndarray | None,
           vocab_size: int) -> dict[str, np.ndarray]:
    """``sample_seq_ids``: the sequence of each sampling row's group, in step order;
    ``num_drafts``: a verify's drafts per group (each group then has 1 + drafts rows); a
    sequence's bitmask rows go to its group's rows in order."""
    ids = np.asarray(bitmask.seq_ids, dtype=np.int64)
    words, mask_of = (vocab_size + 31) // 32, None
    if bitmask.mask_of:
        table, mask_of = _masks(bitmask, words, len(ids))
    else:
        table = rows_of(bitmask, vocab_size)
    keep, rows = (_one_row_each if num_drafts is None else _rows_of_groups)(ids, sample_seq_ids, num_drafts)
    out = {"s_mask_rows": rows}
    if mask_of is not None:
        out.update(s_mask_bits=table, s_mask_of=mask_of[keep])
    else:   # (all kept: the message's own bytes, uncopied)
        out["s_mask_bits"] = table if len(keep) == len(ids) else table[keep]
    return out


def _rows_of_groups(ids: np.ndarray, sample_seq_ids: np.ndarray,
                    num_drafts: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(the entries kept, each one's sampling row) in a verify: a sequence's entries fill its
    group's 1 + drafts rows in order; entries beyond them, or of sequences not sampled, go."""
    sizes = num_drafts + 1
    group = {int(s): [int(f), int(n)] for s, f, n in zip(sample_seq_ids, np.cumsum(sizes) - sizes, sizes)}
    keep, rows = [], []
    for i, s in enumerate(ids.tolist()):
        g = group.get(s)
        if g is not None and g[1] > 0:   # the group's next row
            keep.append(i)
            rows.append(g[0])
            g[0], g[1] = g[0] + 1, g[1] - 1
    return keep, np.asarray(rows, dtype=np.int64)


def _one_row_each(ids: np.ndarray, sample_seq_ids: np.ndarray, _=None) -> tuple[np.ndarray, np.ndarray]:
    """The same for a step without drafts (one row a sequence: its first entry), in numpy: a
    Python loop over 64 rows took 0.1 ms of the worker's critical path here. The engine lists
    a step's sequences in the step's order, which is checked first (3 µs, the search 30)."""
    if len(ids) == len(sample_seq_ids) and (ids == sample_seq_ids).all():
        every = np.arange(len(ids), dtype=np.int64)
        return every, every
    if not len(ids) or not len(sample_seq_ids):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(sample_seq_ids, kind="stable")
    at = order[np.minimum(np.searchsorted(sample_seq_ids, ids, sorter=order), len(order) - 1)]
    found = sample_seq_ids[at] == ids
    first = np.zeros(len(ids), dtype=bool)
    first[np.unique(ids, return_index=True)[1]] = True
    keep = np.flatnonzero(found & first)
    return keep, at[keep].astype(np.int64)


def rows_of(bitmask: pb.TokenBitmask, vocab_size: int) -> np.ndarray:
    """Every entry's packed row ([len(seq_ids), words] int32): in the plain form a read-only
    view of the message's bytes, in the shared form unpacked from its distinct masks."""
    words, num_rows = (vocab_size + 31) // 32, len(bitmask.seq_ids)
    if bitmask.mask_of:
        masks, mask_of = _masks(bitmask, words, num_rows)
        return masks[mask_of]
    data = bitmask.bits   # (each read of a bytes field copies it: 0.1 ms for 64 rows)
    bits = np.frombuffer(data, dtype="<i4")
    if bits.size != num_rows * words or len(data) % 4:
        raise BatchError(f"bitmask: {len(data)} bytes for {num_rows} rows of {words} int32 "
                         f"words (vocabulary {vocab_size})")
    return bits.reshape(num_rows, words)


def _masks(bitmask: pb.TokenBitmask, words: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared form's distinct masks, packed ([masks, words] int32), and each row's index.
    The listed masks' bits are ORed in by one call for all of them (a call per mask cost
    ~12 µs each, and a batch's states list dozens)."""
    mask_of = np.asarray(bitmask.mask_of, dtype=np.int64)
    counts = np.asarray(bitmask.allowed_counts, dtype=np.int64)
    data, ids = bitmask.bits, bitmask.allowed_ids   # (read once: each read copies)
    is_dense = counts < 0
    dense, listed = int(is_dense.sum()), int(counts[~is_dense].sum())
    if len(mask_of) != num_rows or (mask_of >= len(counts)).any():
        raise BatchError(f"bitmask: mask_of has {len(mask_of)} entries for {num_rows} rows and must "
                         f"index its {len(counts)} masks")
    if len(data) != dense * words * 4 or len(ids) != listed * 4:
        raise BatchError(f"bitmask: {len(data)} bytes of packed masks and {len(ids)} "
                         f"of token ids for {dense} packed masks of {words} words and {listed} ids")
    allowed = np.frombuffer(ids, dtype="<u4")
    if allowed.size and int(allowed.max()) >= words * 32:
        raise BatchError(f"bitmask: token id {int(allowed.max())} beyond {words} words")
    masks = np.zeros((len(counts), words), dtype=np.uint32)
    masks[is_dense] = np.frombuffer(data, dtype="<u4").reshape(dense, words)
    if listed:
        rows = np.repeat(np.flatnonzero(~is_dense), counts[~is_dense])
        np.bitwise_or.at(masks.reshape(-1), rows * words + (allowed >> 5).astype(np.intp),
                         np.left_shift(np.uint32(1), (allowed & 31).astype(np.uint32)))
    return masks.view("<i4"), mask_of


def checked_drafts(step: pb.StepRequest, rows: dict[int, int]) -> dict[int, np.ndarray]:
    """Row -> the drafts the control plane checked for it (``rows``: seq id -> row)."""
    if not step.checked_draft_seq_ids:
        return {}
    counts = list(step.checked_draft_counts)
    if len(counts) != len(step.checked_draft_seq_ids) or sum(counts) != len(step.checked_drafts):
        raise BatchError("checked_draft_counts does not match checked_draft_seq_ids / checked_drafts")
    drafts, out, pos = np.asarray(step.checked_drafts, dtype=np.int64), {}, 0
    for seq_id, n in zip(step.checked_draft_seq_ids, counts):
        if seq_id in rows:
            out[rows[seq_id]] = drafts[pos:pos + n]
        pos += n
    return out
