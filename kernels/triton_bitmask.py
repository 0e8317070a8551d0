"""Triton twin of ``headrace.kernels.reference.apply_token_bitmask``: structured outputs' token
mask.

A grammar allows a few tokens of a 150k vocabulary; the control plane ships one bit per token
(packed int32 words, 1/16 of the bf16 logits' bytes). Each program reads one chunk of one
constrained row's words and writes -inf over the logits its bits forbid, in place, in the
logits' own dtype: one launch for the step's constrained rows, no host work, no unpacked mask
ever materialised (the reference builds a [rows, vocab] boolean tensor and a masked copy).
Unconstrained rows are not touched (they are not in ``rows``, or their ``mask_of`` is
negative). With ``mask_of``, row ``rows[k]`` takes mask ``bitmask[mask_of[k]]``: a step's rows
in a few grammar states share a few masks, read in place (no gathered copy of 1.2 MB for 64
rows), and a CUDA graph of a fixed row count covers rows without a mask (``-1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv

_BLOCK = 4096


@triton.jit
def _bitmask_kernel(LOGITS, stride_row, BITS, n_words, ROWS, MASK_OF, V, BLOCK: tl.constexpr,
                    HAS_MASK_OF: tl.constexpr):
    k = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(ROWS + k).to(tl.int64)
    mask = tl.load(MASK_OF + k).to(tl.int64) if HAS_MASK_OF else k.to(tl.int64)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    # The row's bound is 0 without a mask: one comparison, no vector & scalar (triton 3.9's
    # interpreter turns ``vector & scalar`` of booleans into integers a mask refuses).
    inside = cols < tl.where(mask >= 0, V, 0)
    words = tl.load(BITS + mask * n_words + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(LOGITS.dtype.element_ty)
    tl.store(LOGITS + row * stride_row + cols, minus_inf, mask=inside & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        mask_of: torch.Tensor | None = None) -> None:
    n, vocab = rows.numel(), logits.shape[1]
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask: the logits' rows must be contiguous")
    bitmask = bitmask.contiguous()
    _bitmask_kernel[(n, cdiv(vocab, _BLOCK))](logits, logits.stride(0), bitmask, bitmask.shape[1],
                                              rows, rows if mask_of is None else mask_of, vocab,
                                              BLOCK=_BLOCK, HAS_MASK_OF=mask_of is not None, num_warps=4)
