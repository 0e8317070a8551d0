"""Structured outputs on the worker: a step's ``TokenBitmask`` (one packed row per constrained
sequence, as the control plane computed it from the sequence's grammar) becomes the arrays the
sampler applies on the device: ``s_mask_bits`` [rows, words] int32 and ``s_mask_rows``, each
bitmask row's index among the step's sampling rows. Sequences the step does not sample (left
out because they stopped) are skipped; a malformed message is a ``BatchError``."""

from __future__ import annotations

import numpy as np

from dataplane.input_batch import BatchError
from headrace.dataplane.v1 import worker_pb2 as pb


def arrays(bitmask: pb.TokenBitmask, sample_seq_ids: np.ndarray, num_drafts: np.ndarray | None,
           vocab_size: int) -> dict[str, np.ndarray]:
    """``sample_seq_ids``: the sequence of each sampling row's group, in step order;
    ``num_drafts``: a verify's drafts per group (each group then has 1 + drafts rows, and the
    bitmask applies to its first: constrained sequences do not speculate)."""
    words = (vocab_size + 31) // 32
    ids = np.asarray(bitmask.seq_ids, dtype=np.int64)
    bits = np.frombuffer(bitmask.bits, dtype="<i4")
    if bits.size != len(ids) * words or len(bitmask.bits) % 4:
        raise BatchError(f"bitmask: {len(bitmask.bits)} bytes for {len(ids)} rows of {words} int32 "
                         f"words (vocabulary {vocab_size})")
    first = np.arange(len(sample_seq_ids)) if num_drafts is None else np.cumsum(num_drafts + 1) - (num_drafts + 1)
    where = {int(s): int(f) for s, f in zip(sample_seq_ids, first)}
    keep = [i for i, s in enumerate(ids.tolist()) if s in where]
    return {"s_mask_bits": bits.reshape(len(ids), words)[keep].astype(np.int32),
            "s_mask_rows": np.asarray([where[int(ids[i])] for i in keep], dtype=np.int64)}
