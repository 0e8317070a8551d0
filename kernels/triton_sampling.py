"""Triton twin of ``headrace.kernels.reference.sample_race``: sampling in one read of the logits.

The exponential race needs no softmax (argmax of p / E equals argmax of logits / t - log E),
so each program reads one chunk of one row's logits in their own dtype, adds the hashed noise
(the reference's bits: a splitmix64 key per row, then 32-bit mixing per token) and keeps the
chunk's best; a second tiny kernel picks each row's best chunk. Against the torch sampler this
replaces a float32 copy, a temperature division, a softmax, the noise tensor, a division and
an argmax over [rows, vocab] with one pass over the bf16 logits.

Compiled, the kernel takes the noise's two logarithms from the hardware's approximate log2 and
multiplies by 1/t (accurate logf and an IEEE division cost ~40 instructions per token, most of
the kernel's time). Its scores then differ from the reference's by ~1e-6, so a row whose two
best tokens score within that of each other can pick the other one: the same draw from the same
distribution, but not the reference's exact token in such near ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from headrace.kernels.host import cdiv, next_pow2
from headrace.kernels.triton_flash import INTERPRETED   # no fast log in Triton's CPU interpreter

_CHUNK = 4096


@triton.jit
def _race_chunk_kernel(LOGITS, stride_row, TEMP, SEEDS, COUNTERS, BEST_VAL, BEST_IDX, V, n_chunks,
                       BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(LOGITS + row.to(tl.int64) * stride_row + cols, mask=mask,
                other=float("-inf")).to(tl.float32)
    t = tl.load(TEMP + row)
    if t > 0:
        seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
        counter = tl.load(COUNTERS + row).to(tl.uint64, bitcast=True)
        k = (seed * 0x9E3779B97F4A7C15) ^ (counter * 0x94D049BB133111EB)   # the row's key
        k = k + 0x9E3779B97F4A7C15
        k = (k ^ (k >> 30)) * 0xBF58476D1CE4E5B9
        k = (k ^ (k >> 27)) * 0x94D049BB133111EB
        k = k ^ (k >> 31)
        key_lo = (k & 0xFFFFFFFF).to(tl.uint32)
        key_hi = (k >> 32).to(tl.uint32)
        h = (cols.to(tl.uint32) ^ key_hi) * tl.full((), 0x9E3779B1, tl.uint32) + key_lo
        h = h ^ (h >> 16)
        h = h * tl.full((), 0x85EBCA6B, tl.uint32)
        h = h ^ (h >> 13)
        h = h * tl.full((), 0xC2B2AE35, tl.uint32)
        h = h ^ (h >> 16)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if FAST_LOG:   # the hardware's approximate log2 (MUFU); accurate logf costs ~20 ops
            x = x * (1.0 / t) - libdevice.fast_logf(-libdevice.fast_logf(u))
        else:
            x = x / t - tl.log(-tl.log(u))
        x = tl.where(mask, x, float("-inf"))
    best = tl.argmax(x, 0)
    val = tl.max(x, 0)
    tl.store(BEST_VAL + row * n_chunks + chunk, val)
    tl.store(BEST_IDX + row * n_chunks + chunk, chunk * BLOCK + best)


@triton.jit
def _race_reduce_kernel(BEST_VAL, BEST_IDX, OUT, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_chunks
    vals = tl.load(BEST_VAL + row * n_chunks + offs, mask=mask, other=float("-inf"))
    best = tl.argmax(vals, 0)
    tl.store(OUT + row, tl.load(BEST_IDX + row * n_chunks + best).to(tl.int64))


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_chunks = cdiv(vocab, _CHUNK)
    best_val = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    _race_chunk_kernel[(rows, n_chunks)](logits, logits.stride(0), temperature, seeds, counters,
                                         best_val, best_idx, vocab, n_chunks, BLOCK=_CHUNK,
                                         FAST_LOG=not INTERPRETED, num_warps=8)
    _race_reduce_kernel[(rows,)](best_val, best_idx, out, n_chunks,
                                 BLOCK=max(16, next_pow2(n_chunks)), num_warps=1)
    return out
