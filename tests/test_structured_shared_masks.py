"""controlplane/structured/shared_masks.py with dataplane/bitmasks.py: a step's bitmask rows
cross in TokenBitmask's shared form (each distinct mask once, sparse ones as token ids) and the
worker reads back exactly the rows the control plane filled; a malformed shared form is a
BatchError, never a wrong mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.structured import shared_masks
from headrace.dataplane import bitmasks
from headrace.dataplane.input_batch import BatchError
from headrace.worker.v1 import worker_pb2 as wpb

VOCAB = 151_936                 # Qwen's: 4,748 words a row
WORDS = (VOCAB + 31) // 32


def _mask(allowed) -> np.ndarray:
    flags = np.zeros(WORDS * 32, dtype=np.uint8)
    flags[list(allowed)] = 1
    return np.packbits(flags, bitorder="little").view("<i4")


def _uploaded_rows(out: dict) -> np.ndarray:
    """The rows the sampler applies: ``s_mask_bits``, gathered by ``s_mask_of`` when shared."""
    return out["s_mask_bits"] if "s_mask_of" not in out else out["s_mask_bits"][out["s_mask_of"]]


def _wire(rows: np.ndarray, shared_from: int = 0) -> wpb.TokenBitmask:
    msg = wpb.TokenBitmask(seq_ids=range(100, 100 + len(rows)))
    shared_masks.pack(rows, msg, shared_from)
    return wpb.TokenBitmask.FromString(msg.SerializeToString())


def test_a_batch_of_one_schema_crosses_as_its_distinct_masks():
    key, digits, anything = _mask({7}), _mask(range(300, 310)), np.full(WORDS, -1, dtype="<i4")
    rows = np.stack([key, digits, key, anything, digits, key] * 10)
    msg = _wire(rows, shared_masks.SHARED_FROM_BYTES)   # 1.1 MB: the engine sends it shared
    assert list(msg.mask_of[:6]) == [0, 1, 0, 2, 1, 0] and list(msg.allowed_counts) == [1, 10, -1]
    assert len(msg.bits) == WORDS * 4 and msg.ByteSize() < 2 * WORDS * 4   # 60 rows: 1.2 MB plain
    out = bitmasks.arrays(msg, np.arange(100, 160), None, VOCAB)
    assert out["s_mask_bits"].shape == (3, WORDS)   # uploaded once each, gathered on the device
    assert np.array_equal(_uploaded_rows(out), rows) and out["s_mask_rows"].tolist() == list(range(60))


def test_only_a_sparse_mask_crosses_as_token_ids():
    few, many = _mask(range(0, 2960, 10)), _mask(range(0, 10120, 10))   # 296 and 1,012 tokens
    rows = np.stack([few, many] * 4)
    msg = _wire(rows)
    assert list(msg.allowed_counts) == [296, -1]   # 1,012 ids: the packed row is cheaper to make
    assert len(msg.allowed_ids) == 296 * 4 and len(msg.bits) == WORDS * 4
    assert np.array_equal(_uploaded_rows(bitmasks.arrays(msg, np.arange(100, 108), None, VOCAB)), rows)


def test_one_row_and_small_steps_keep_the_plain_form():
    msg = _wire(_mask({1, 2})[None])
    assert not msg.mask_of and len(msg.bits) == WORDS * 4
    rows = np.stack([_mask({1, 2})] * 6)              # 114 KB: under the engine's threshold
    msg = _wire(rows, shared_masks.SHARED_FROM_BYTES)
    assert not msg.mask_of and len(msg.bits) == rows.nbytes
    assert np.array_equal(bitmasks.rows_of(msg, VOCAB), rows)


@pytest.mark.parametrize("colliding", [False, True])
def test_rows_with_equal_digests_but_different_bits_stay_apart(monkeypatch, colliding):
    """The digest only groups rows: each is compared in full (here every digest collides)."""
    if colliding:
        monkeypatch.setattr(shared_masks.xxhash, "xxh3_64_intdigest", lambda data: 0)
    a = _mask({0})                    # words [1, 0, ...]
    b = a.copy()
    b[0], b[1] = 0, 1                 # token 32: the same sum of words
    c = _mask({0, 5})
    rows = np.stack([a, b, a, c, b, c])
    msg = _wire(rows)
    assert list(msg.mask_of) == [0, 1, 0, 2, 1, 2]
    assert np.array_equal(bitmasks.rows_of(msg, VOCAB), rows)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(range(5)), min_size=2, max_size=24), st.integers(0, 2 ** 32 - 1),
       st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_the_worker_reads_back_exactly_the_rows_sent(choice, seed, keep):
    rng = np.random.default_rng(seed)
    palette = [_mask(rng.choice(VOCAB, k, replace=False)) for k in (0, 3, 500, WORDS + 1)]
    palette.append(rng.integers(-2 ** 31, 2 ** 31 - 1, WORDS).astype("<i4"))   # dense noise
    rows = np.stack([palette[c] for c in choice])
    msg = _wire(rows)
    assert np.array_equal(bitmasks.rows_of(msg, VOCAB), rows)
    sampled = np.array(sorted({100 + k % len(rows) for k in keep}))   # some rows do not sample
    out = bitmasks.arrays(msg, sampled, None, VOCAB)
    assert np.array_equal(_uploaded_rows(out), rows[sampled - 100])
    assert out["s_mask_rows"].tolist() == list(range(len(sampled)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=20), st.lists(st.integers(0, 12), max_size=12, unique=True))
def test_rows_without_drafts_are_mapped_as_a_verify_with_no_drafts_maps_them(ids, sampled):
    """Each sampled sequence's first entry gets its row; repeats and unsampled ones go."""
    ids, sampled = np.array(ids, dtype=np.int64), np.array(sampled, dtype=np.int64)
    keep, rows = bitmasks._one_row_each(ids, sampled)
    want_keep, want_rows = bitmasks._rows_of_groups(ids, sampled, np.zeros(len(sampled), np.int64))
    assert list(keep) == want_keep and rows.tolist() == want_rows.tolist()


def test_listed_ids_are_a_set():
    msg = _wire(np.stack([_mask({4, 9}), np.full(WORDS, -1, dtype="<i4")]))
    assert list(msg.allowed_counts) == [2, -1]
    msg.allowed_ids = np.array([9, 4], "<u4").tobytes()
    assert np.array_equal(bitmasks.rows_of(msg, VOCAB)[0], _mask({4, 9}))
    msg.allowed_ids = np.array([4, 4], "<u4").tobytes()   # a repeat is the same bit
    assert np.array_equal(bitmasks.rows_of(msg, VOCAB)[0], _mask({4}))


@pytest.mark.parametrize("change, message", [
    (lambda m: m.mask_of.append(0), "mask_of has 3 entries for 2 rows"),
    (lambda m: m.mask_of.__setitem__(1, 5), "must index its"),
    (lambda m: setattr(m, "allowed_ids", m.allowed_ids[:-4]), "of token ids"),
    (lambda m: setattr(m, "bits", m.bits + b"\0\0\0\0"), "bytes of packed masks"),
    (lambda m: setattr(m, "allowed_ids", np.array([WORDS * 32, 1], "<u4").tobytes()), "beyond"),
])
def test_a_malformed_shared_form_is_a_batch_error(change, message):
    msg = _wire(np.stack([_mask({4, 9}), np.full(WORDS, -1, dtype="<i4")]))
    change(msg)
    with pytest.raises(BatchError, match=message):
        bitmasks.arrays(msg, np.array([100, 101]), None, VOCAB)
