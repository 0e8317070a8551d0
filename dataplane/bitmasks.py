"""Structured outputs on the worker: a step's ``TokenBitmask`` (one packed row per constrained
sequence, as the control plane computed it from the sequence's grammar; one per verified
position for a sequence verifying checked drafts) becomes the arrays the sampler applies on the
device: ``s_mask_bits`` [rows, words] int32 and ``s_mask_rows``, each bitmask row's index among
the step's sampling rows. Sequences the step does not sample (left out because they stopped)
are skipped; a malformed message is a ``BatchError``. The rows are read where the message
holds them (a read-only view; the upload to the device is their one copy). ``checked_drafts`` reads the drafts the
control plane checked against the grammars (``StepRequest.checked_drafts``)."""

from __future__ import annotations

import numpy as np

from dataplane.input_batch import BatchError
from headrace.dataplane.v1 import worker_pb2 as pb


def arrays(bitmask: pb.TokenBitmask, sample_seq_ids: np.ndarray, num_drafts: np.ndarray | None,
           vocab_size: int) -> dict[str, np.ndarray]:
    """``sample_seq_ids``: the sequence of each sampling row's group, in step order;
    ``num_drafts``: a verify's drafts per group (each group then has 1 + drafts rows); a
    sequence's bitmask rows go to its group's rows in order."""
    words = (vocab_size + 31) // 32
    ids = np.asarray(bitmask.seq_ids, dtype=np.int64)
    bits = np.frombuffer(bitmask.bits, dtype="<i4")
    if bits.size != len(ids) * words or len(bitmask.bits) % 4:
        raise BatchError(f"bitmask: {len(bitmask.bits)} bytes for {len(ids)} rows of {words} int32 "
                         f"words (vocabulary {vocab_size})")
    sizes = np.ones(len(sample_seq_ids), np.int64) if num_drafts is None else num_drafts + 1
    group = {int(s): [int(f), int(n)] for s, f, n in zip(sample_seq_ids, np.cumsum(sizes) - sizes, sizes)}
    keep, rows = [], []
    for i, s in enumerate(ids.tolist()):
        g = group.get(s)
        if g is not None and g[1] > 0:   # the group's next row
            keep.append(i)
            rows.append(g[0])
            g[0], g[1] = g[0] + 1, g[1] - 1
    table = bits.reshape(len(ids), words)
    if len(keep) != len(ids):   # (all kept: the message's own bytes, uncopied; the upload copies)
        table = table[keep]
    return {"s_mask_bits": table, "s_mask_rows": np.asarray(rows, dtype=np.int64)}


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
