"""Batch-invariant plain-torch twins of ``headrace.kernels.reference.linear`` and ``paged_attention``:
a row's result does not depend on the other rows of the call, how many there are, or (for
attention) whether its query came alone (a decode) or in a chunk of a prompt (a prefill).
``--deterministic`` runs them on the CPU (``headrace.kernels.batch_invariant``).

Why the reference itself is not: torch's CPU matrix products (MKL's sgemm, oneDNN for
bfloat16) choose their kernels by shape, and measured on this repository's machine (MKL
2024.2, AVX-512) a row multiplied alone (M = 1), or in a product of 2, 3, 5, 6, 7 or 10 rows,
gets other bits than the same row in a larger product; in products whose row count is a
multiple of 4 (of 16 for bfloat16) every row got the same bits, whatever its position and
neighbours, up to 1,600 rows (``tests/test_batch_invariant_reference.py`` checks this where
it runs). So:

* ``linear`` pads the rows to a multiple of ``ROW_MULTIPLE`` (16: both dtypes) and runs one
  product (the padding rows are zeros and are dropped): at most 15 wasted rows a call. A
  weight of fewer than ``ROW_MULTIPLE`` output columns is padded to that many too: with 2-9
  columns MKL gave a row other bits at another position within the same padded product
  (session 28, a property-test example: 406 of 3,000 random cases; 0 once padded).
* ``paged_attention`` runs, per sequence, an online softmax over the keys in fixed chunks of
  ``KEY_CHUNK`` positions counted from position 0, with the queries padded to a multiple of
  ``ROW_MULTIPLE`` rows: every product has a fixed inner dimension (head_dim, then the chunk)
  and a padded row count, so a query's scores, weights and sum see the same operations in the
  same order whether it is a decode (one query over its context) or one row of a prefill
  chunk (whose later keys it masks: a chunk entirely past a query adds exact zeros). Keys past
  a sequence's context are never read (their scores are -inf, their values zeros).

Elementwise exponentials and logarithms are not row-wise on the CPU either: torch runs a
contiguous loop in vectors (SLEEF) and its last ``numel % (2 x vector width)`` elements one by
one (libm), and splits loops of 32,768 elements or more over threads at arbitrary element
offsets, so an element's result (one ulp apart between the two) depends on where it sits in
the batch: measured here, a row's SiLU changed when the batch grew from 150 to 51 rows (the
thread split fell inside it). ``elementwise`` runs such an op so that every element takes the
vector path (blocks of whole vectors below the threading threshold); ``silu_and_mul`` and
the sampler's noise (``race_noise``, ``race``) use it. Norms, rotary (products and sums only:
the same IEEE operations either way), softmax and log-softmax over rows (torch's row kernels)
are row-wise already and stay ``headrace.kernels.reference``'s.
"""

from __future__ import annotations

import torch

from headrace.kernels import kv_layout, reference
from headrace.kernels.reference import _gather_context

ROW_MULTIPLE = 16     # rows of every product are padded to a multiple of this
KEY_CHUNK = 256       # keys per online-softmax step (a multiple of ROW_MULTIPLE)
VECTOR = 64           # elements: a multiple of every CPU vector loop's step (2 x 16 floats)
SERIAL = 32768 - VECTOR   # a loop of fewer than torch's GRAIN_SIZE elements runs on one thread


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (one torch kernel), each element through the
    vectorized path whatever its position: x flattened, zero-padded to whole VECTORs and run in
    blocks of SERIAL elements."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-max(n, 1) // VECTOR) * VECTOR, dtype=x.dtype, device=x.device)
    padded[:n] = flat
    out = torch.cat([fn(padded[i:i + SERIAL]) for i in range(0, padded.numel(), SERIAL)])
    return out[:n].view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """headrace.kernels.reference.silu_and_mul, its SiLU through ``elementwise``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise(torch.nn.functional.silu, gate) * up


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """headrace.kernels.reference.race_noise with its logarithm through ``elementwise``."""
    return -elementwise(torch.log, reference.race_uniform(seeds, counters, vocab))


def race(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """headrace.kernels.reference.race with its logarithm through ``elementwise``."""
    x = logits.float()
    t = temperature.float()[:, None]
    noisy = x / torch.where(t > 0, t, 1.0) - elementwise(torch.log, noise)
    return torch.where(t > 0, noisy, x).argmax(-1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    padded = -(-max(rows, 1) // ROW_MULTIPLE) * ROW_MULTIPLE
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros((padded - rows, *x.shape[1:]))])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), each row's bits independent of the others (rows padded to a
    multiple of ROW_MULTIPLE)."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if n < ROW_MULTIPLE:   # (few output columns: see the module doc)
        weight = torch.cat([weight, weight.new_zeros((ROW_MULTIPLE - n, k))])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(ROW_MULTIPLE - n)])
    out = torch.nn.functional.linear(_pad_rows(x2, rows), weight, bias)[:rows, :n]
    return out.reshape(*x.shape[:-1], n)


def _attend_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: int,
                     group: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """One sequence's n queries (the last n of its ctx positions), float32 [n, H, D]."""
    n, heads, dim = q.shape
    qp = _pad_rows(q, n).transpose(0, 1)                    # [H, n_pad, D]
    q_pos = torch.arange(ctx - n, ctx)
    q_pos = _pad_rows(q_pos, n)                              # padded rows: position 0
    rows = qp.shape[1]
    m = torch.full((heads, rows, 1), float("-inf"))
    l = torch.zeros((heads, rows, 1))
    acc = torch.zeros((heads, rows, dim))
    for start in range(0, ctx, KEY_CHUNK):
        stop = min(ctx, start + KEY_CHUNK)
        k = torch.zeros((KEY_CHUNK, heads // group, dim))
        v = torch.zeros_like(k)
        k[:stop - start] = k_cache[start:stop]
        v[:stop - start] = v_cache[start:stop]
        k = (k * k_scale).repeat_interleave(group, 1).transpose(0, 1)   # [H, chunk, D]
        v = (v * v_scale).repeat_interleave(group, 1).transpose(0, 1)
        s = torch.matmul(qp, k.transpose(1, 2)) * scale                  # [H, n_pad, chunk]
        k_pos = torch.arange(start, start + KEY_CHUNK)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx)
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = elementwise(torch.exp, m - m_new)
        p = elementwise(torch.exp, s - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v)
        m = m_new
    out = acc / torch.where(l > 0, l, 1.0)
    return out.transpose(0, 1)[:n]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """headrace.kernels.reference.paged_attention's semantics, each query row's bits a function of its
    own query, position and keys only (see the module docstring)."""
    out = torch.empty_like(query)
    heads, kv_heads = query.shape[1], kv_cache.shape[3]
    group = heads // kv_heads
    starts = query_start_loc.tolist()
    if kv_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    for i, ctx in enumerate(seq_lens.tolist()):
        if starts[i + 1] == starts[i]:
            continue
        q = query[starts[i]:starts[i + 1]].float()
        k = _gather_context(kv_cache[0], block_tables[i], ctx).float()
        v = _gather_context(kv_layout.values(kv_cache), block_tables[i], ctx).float()
        out[starts[i]:starts[i + 1]] = _attend_sequence(
            q, k, v, ctx, group, scale, k_scale, v_scale).to(query.dtype)
    return out
