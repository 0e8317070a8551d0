"""The batched LoRA update: ``headrace.kernels.reference_lora`` against the per-token formula, and
``headrace.kernels.triton_lora`` against the reference (mixed slots, tokens without an adapter, merged
projections of 1-3 slices, split K, strided slot buffers), on small shapes: compiled on a
GPU, else under Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()   # before triton is imported
from headrace.kernels import reference_lora as ref, triton_lora  # noqa: E402


def _per_token(y, x, a, b, slots, slices, scale):
    """y + scale * (x[t] @ A_i^T) @ B_i^T for each token t of slot >= 0, slice by slice."""
    out = y.clone().float()
    rank = b.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i in range(len(slices) - 1):
            lo, hi = slices[i], slices[i + 1]
            h = x[t].float() @ a[s, i * rank:(i + 1) * rank].float().t()
            out[t, lo:hi] += scale * (h @ b[s, lo:hi].float().t())
    return out.to(y.dtype)


def _case(tokens, k, slices, rank, num_slots, dtype, seed=0, none_every=3):
    g = torch.Generator().manual_seed(seed)
    width = slices[-1]
    pieces = len(slices) - 1
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = (torch.randn(num_slots, pieces * rank, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(num_slots, width, rank, generator=g).to(dtype)
    y = torch.randn(tokens, width, generator=g).to(dtype)
    slots = torch.randint(0, num_slots, (tokens,), generator=g)
    slots[::none_every] = -1   # tokens of no adapter
    return x, a, b, y, slots


@pytest.mark.parametrize("slices", [(0, 48), (0, 32, 48, 64), (0, 40, 80)])
def test_reference_matches_the_per_token_formula(slices):
    x, a, b, y, slots = _case(11, 24, slices, 4, 3, torch.float32)
    meta = ref.meta_of(slots, 3)
    out = ref.lora_add(y.clone(), x, a, b, meta, slices, scale=0.5)
    torch.testing.assert_close(out, _per_token(y, x, a, b, slots, slices, 0.5))
    untouched = slots < 0
    assert torch.equal(out[untouched], y[untouched])


def test_reference_without_adapters_leaves_y():
    x, a, b, y, _ = _case(5, 16, (0, 16), 4, 2, torch.float32)
    meta = ref.meta_of(torch.full((5,), -1), 2)
    assert meta.segments == () and not any(b.any() for b in meta.blocks)
    assert torch.equal(ref.lora_add(y.clone(), x, a, b, meta, (0, 16)), y)


def _on(device, *ts):
    return [t.to(device) for t in ts]


def _dev(meta):
    return ref.LoraMeta(meta.order.to(DEVICE), tuple(b.to(DEVICE) for b in meta.blocks), meta.segments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,slices,rank,num_slots", [
    (1, 64, (0, 96), 16, 2),               # one decode token: the fused kernel
    (7, 300, (0, 64, 80, 96), 8, 4),       # q/k/v of a merged projection, rank < 16 (padded)
    (40, 200, (0, 48, 96), 16, 3),         # gate/up; a slot with more than one block of 16
    (80, 96, (0, 40), 32, 2),              # a prefill: shrink + expand, rank 32
    (150, 72, (0, 24, 40, 56), 16, 3),     # three slices, more than one block of 64 per slot
])
def test_triton_matches_reference(dtype, tokens, k, slices, rank, num_slots):
    x, a, b, y, slots = _case(tokens, k, slices, rank, num_slots, dtype, seed=tokens)
    meta = ref.meta_of(slots, num_slots)
    expected = ref.lora_add(y.clone(), x, a, b, meta, slices, scale=2.0)
    x, a, b, y = _on(DEVICE, x, a, b, y)
    got = triton_lora.lora_add(y.clone(), x, a, b, _dev(meta), slices, scale=2.0)
    tol = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu().float(), expected.float(), **tol)
    none = (slots < 0).to(DEVICE)
    assert torch.equal(got[none], y[none])   # rows of no adapter: not touched


def test_fused_and_two_kernel_paths_agree():
    """The small-step kernel (one launch) and the shrink + expand give the same update."""
    x, a, b, y, slots = _case(24, 160, (0, 32, 48, 64), 8, 3, torch.float32, seed=3)
    meta = _dev(ref.meta_of(slots, 3))
    x, a, b, y = _on(DEVICE, x, a, b, y)
    fused = triton_lora.lora_fused(y.clone(), x, a, b, meta, (0, 32, 48, 64))
    split = triton_lora.lora_expand(y.clone(), triton_lora.lora_shrink(x, a, meta), b, meta, (0, 32, 48, 64))
    torch.testing.assert_close(fused.cpu(), split.cpu(), atol=1e-4, rtol=1e-4)
    used = (slots >= 0)
    parts = triton_lora.lora_shrink(x, a, meta)   # a small step: K split over programs
    assert parts.shape[0] == triton_lora.shrink_splits(24, 160) > 1
    shrunk = parts.sum(0).cpu()
    whole = triton_lora.lora_shrink(x, a, meta, splits=1)[0].cpu()
    for got in (shrunk, whole):
        torch.testing.assert_close(got[used], ref.lora_shrink(x.cpu(), a.cpu(), ref.meta_of(slots, 3))[0][used],
                                   atol=1e-4, rtol=1e-4)


def test_triton_strided_slot_buffers_and_empty_steps():
    """Slot buffers are strided views of one pool (a slot's layers contiguous, ``headrace.dataplane.lora``);
    a slot without tokens, and a step without any adapter, write nothing."""
    x, a, b, y, slots = _case(9, 64, (0, 48), 16, 3, torch.float32)
    slots[slots == 1] = 2   # slot 1 has no token
    pool = torch.randn(3, a[0].numel() + b[0].numel() + 7)
    a_view = pool[:, 7:7 + a[0].numel()].view(3, *a.shape[1:])
    b_view = pool[:, 7 + a[0].numel():].view(3, *b.shape[1:])
    a_view.copy_(a)
    b_view.copy_(b)
    meta = ref.meta_of(slots, 3)
    expected = ref.lora_add(y.clone(), x, a, b, meta, (0, 48))
    pool = pool.to(DEVICE)
    a_view = pool[:, 7:7 + a[0].numel()].view(3, *a.shape[1:])
    b_view = pool[:, 7 + a[0].numel():].view(3, *b.shape[1:])
    got = triton_lora.lora_add(y.clone().to(DEVICE), x.to(DEVICE), a_view, b_view, _dev(meta), (0, 48))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    nobody = _dev(ref.meta_of(torch.full((9,), -1), 3))
    yd = y.to(DEVICE)
    for add in (triton_lora.lora_add, triton_lora.lora_fused):
        assert torch.equal(add(yd.clone(), x.to(DEVICE), a_view, b_view, nobody, (0, 48)), yd)
    big = _dev(ref.meta_of(torch.full((70,), -1), 3))   # (the two-kernel path's empty lists)
    y70, x70 = torch.randn(70, 48, device=DEVICE), torch.randn(70, 64, device=DEVICE)
    assert torch.equal(triton_lora.lora_add(y70.clone(), x70, a_view, b_view, big, (0, 48)), y70)


def test_block_lists_bound_the_grid():
    counts = [0, 17, 1, 0, 40]
    rows = ref.block_rows(counts, 16, ref.max_blocks(58, 5, 16))
    assert rows[:6].tolist() == [[1, 0, 16], [1, 16, 1], [2, 17, 1], [4, 18, 16], [4, 34, 16],
                                 [4, 50, 8]]
    assert not rows[6:].any() and len(rows) == 4 + 5
