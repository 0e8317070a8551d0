"""headrace.dataplane.staging: a step's arrays packed into one buffer come back as the same typed
arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headrace.dataplane import staging


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "positions": rng.integers(0, 1 << 40, size=7, dtype=np.int64),
        "seq_lens": rng.integers(0, 1000, size=3, dtype=np.int32),
        "tables": rng.integers(0, 500, size=(3, 5), dtype=np.int32),
        "empty": np.zeros(0, dtype=np.int64),
        "temp": rng.random(5, dtype=np.float32),
        "flags": rng.random(9) > 0.5,
        "after_odd": np.arange(3, dtype=np.int64),   # follows an odd-sized bool array
    }


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_copy_round_trips_every_dtype_and_shape(device):
    arrays = _arrays()
    for out in (staging.packed_copy(arrays, torch.device(device), pin=device == "cuda"),
                staging.upload(arrays, torch.device(device))):
        assert list(out) == list(arrays)
        for name, a in arrays.items():
            t = out[name]
            assert t.shape == a.shape and t.device.type == device, name
            np.testing.assert_array_equal(t.cpu().numpy(), a, err_msg=name)
            if t.numel():   # Triton specialises on 16-byte alignment: keep it stable
                assert t.data_ptr() % 16 == 0, name


def test_download_is_readable_after_the_stream_passes():
    t = torch.arange(10)
    host = staging.download(t)
    if torch.cuda.is_available():
        host = staging.download(t.cuda())
        torch.cuda.synchronize()
    assert host.tolist() == list(range(10))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_stager_reuses_its_pinned_buffers_only_after_their_copies_ran(device):
    """More uploads than buffers, one larger than their capacity, queued behind a long kernel
    (on a GPU): every upload arrives intact, so no buffer was refilled before its copy ran."""
    stager = staging.Stager(torch.device(device), depth=2, capacity=16)
    if device == "cuda":
        torch.cuda._sleep(50_000_000)   # the copies below wait behind this on the stream
    sets = [{"a": np.full(3 + 40 * i, i, dtype=np.int64), "b": np.arange(i + 1, dtype=np.int32)}
            for i in range(5)]
    outs = [stager.upload(arrays) for arrays in sets]
    for arrays, out in zip(sets, outs):
        for name, a in arrays.items():
            np.testing.assert_array_equal(out[name].cpu().numpy(), a, err_msg=name)
