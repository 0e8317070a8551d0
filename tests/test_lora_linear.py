"""A small step's projection with its LoRA update in one launch:
``headrace.kernels.triton_lora_linear`` against ``reference_lora.lora_linear`` (the projection,
then the update), for one adapter, several in one step, rows of none, a bias, merged
projections of 1-3 slices and strided slot buffers; compiled on a GPU, else under Triton's CPU
interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported
from headrace.kernels import reference_lora as ref, triton_lora_linear as fused  # noqa: E402


def _case(tokens, k, slices, rank, num_slots, dtype, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, pieces = slices[-1], len(slices) - 1
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    a = (torch.randn(num_slots, pieces * rank, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(num_slots, n, rank, generator=g).to(dtype)
    return x, w, bias, a, b, torch.tensor(slots)


def _dev(meta):
    return ref.LoraMeta(meta.order.to(DEVICE), tuple(b.to(DEVICE) for b in meta.blocks), meta.segments)


def _check(x, w, bias, a, b, slots, slices, scale=0.5, atol=1e-3, launch=None):
    meta = ref.meta_of(slots, a.shape[0])
    expected = ref.lora_linear(x.float(), w.float(), None if bias is None else bias.float(), a.float(),
                               b.float(), meta, slices, scale)
    got = fused.lora_linear(x.to(DEVICE), w.to(DEVICE), None if bias is None else bias.to(DEVICE),
                            a.to(DEVICE), b.to(DEVICE), _dev(meta), slices, scale, launch=launch)
    torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=atol)
    return got


@pytest.mark.parametrize("slices,slots", [
    ((0, 48), [0]),                                  # a batch-1 decode of one adapter
    ((0, 32, 48, 64), [2, -1, 2, 0, 1, -1, 0]),      # q/k/v; three adapters and the base model
    ((0, 40, 80), [1] * 16),                         # gate/up; a full 16-token step of one adapter
    ((0, 40, 80), [-1, -1, -1]),                     # no adapter: the plain projection
])
def test_one_launch_equals_the_projection_then_the_update(slices, slots):
    x, w, bias, a, b, s = _case(len(slots), 96, slices, 8, 3, torch.float32, slots)
    _check(x, w, bias, a, b, s, slices)
    _check(x, w, None, a, b, s, slices, launch=fused.Launch(16, 32, 4, 2))   # K in steps, no bias


def test_bfloat16_and_long_rows():
    slots = [0, 1, -1, 1]
    x, w, bias, a, b, s = _case(4, 320, (0, 64), 16, 2, torch.bfloat16, slots, seed=2)
    _check(x, w, bias, a, b, s, (0, 64), atol=5e-2, launch=fused.Launch(16, 64, 4, 2))


def test_strided_slot_buffers_and_rows_of_no_adapter_get_the_plain_projection():
    """Slot buffers are strided views of one pool (``headrace.dataplane.lora.slots``)."""
    slots = [1, -1, 1, -1]
    x, w, bias, a, b, s = _case(4, 64, (0, 48), 16, 3, torch.float32, slots, seed=5)
    pool = torch.randn(3, a[0].numel() + b[0].numel() + 5)
    a_view = pool[:, 5:5 + a[0].numel()].view(3, *a.shape[1:])
    b_view = pool[:, 5 + a[0].numel():].view(3, *b.shape[1:])
    a_view.copy_(a)
    b_view.copy_(b)
    pool = pool.to(DEVICE)
    a_dev = pool[:, 5:5 + a[0].numel()].view(3, *a.shape[1:])
    b_dev = pool[:, 5 + a[0].numel():].view(3, *b.shape[1:])
    meta = ref.meta_of(s, 3)
    got = fused.lora_linear(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), a_dev, b_dev, _dev(meta), (0, 48))
    expected = ref.lora_linear(x, w, bias, a, b, meta, (0, 48))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-3, rtol=1e-3)
    plain = x @ w.t() + bias
    torch.testing.assert_close(got.cpu()[s < 0], plain[s < 0], atol=1e-4, rtol=1e-4)


def test_steps_it_does_not_take_are_refused():
    x, w, bias, a, b, s = _case(17, 32, (0, 16), 4, 2, torch.float32, [0] * 17)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fused.lora_linear(x, w, bias, a, b, ref.meta_of(s, 2), (0, 16))
