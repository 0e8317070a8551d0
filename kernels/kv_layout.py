"""Where a token's key and value live in a layer's paged KV cache, per cache dtype.

A layer's cache is one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor: ``[0]``
holds keys, ``[1]`` values. Keys are always stored token-major (``[block, slot, head, d]``), and
so are the values of a bf16 / fp16 / fp32 cache (flash-attn-4's paged layout). An FP8 cache
stores its values **transposed within each block**: the ``[1]`` half's memory is
``[num_blocks, kv_heads, head_dim, block_size]``, each (block, head, d) a run of block_size
bytes along the keys.

The hardware reason: attention's second product, P @ V, needs V as a tensor-core operand along
the keys. A token-major bf16 tile gets there through ``ldmatrix.trans``; SM90 has no 8-bit
``ldmatrix.trans``, so a token-major FP8 tile was read from shared memory a byte at a time
(128 ``ld.shared.b8`` a thread per 128-key tile: ``python -m bench.decode_ptx --plain-v``) and
FP8 decode attention read at 2.4-2.6 TB/s against bf16's 4.0-4.3. Stored along the keys, the
tile is copied in 16-byte runs and reaches the tensor cores by ``ldmatrix`` without byte loads
(FlashAttention-3 transposes FP8 V in shared memory for the same reason; a layout that is
already transposed needs no kernel of that kind). Measured on the H200 (2026-12-03,
``bench/fp8_kv_attention.py``, same call): decode 0.67-0.71x of bf16's time at batch 256,
context 2,048, against 0.79-0.82x token-major (3.1 TB/s of FP8 against 2.6).

**An FP8 cache holds no NaN**, so attention may read a block's slots past a context: its writes
store NaN as 0 (``reference._to_cache``, ``triton_e4m3.scaled_e4m3``; e4m3fn has no inf, and
+-inf saturate to +-448), and the pool starts zeroed (``headrace.dataplane.kv_cache.allocate``). A masked
load along a transposed run is not vectorised: a context's last decode tile, its V masked per
key, was read a byte at a time (128 ``ld.global.b8`` a thread). It is read in whole blocks
instead; the keys past the context weigh nothing (their scores are masked, p = 0, and 0 times a
finite value is 0). Whole-block copies carry the property along.

Everything that reads or writes values by token goes through ``values``; whole-block copies
(copy-on-write, the host tier, transfers) move both halves' bytes and need not know. Prefill
over the layout reads each tile's block-table entries once (``triton_flash._tile_blocks``).
"""

from __future__ import annotations

import torch


def values_transposed(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype stores V transposed within each block."""
    return dtype == torch.float8_e4m3fn


def check_block_size(dtype: torch.dtype, block_size: int) -> None:
    """A cache that stores V transposed is read in runs of whole blocks along the keys, which
    the kernels tile in powers of two: its block size must be one."""
    if values_transposed(dtype) and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"--block-size {block_size}: an FP8 KV cache needs a power-of-two block "
                         "size (16, the default, or 8, 32, 64, ...)")


def values(kv_cache: torch.Tensor) -> torch.Tensor:
    """The values of a layer's cache as a ``[num_blocks, block_size, kv_heads, head_dim]`` view
    (token-major indexing whatever the storage; writes through it land in the cache)."""
    v = kv_cache[1]
    if not values_transposed(kv_cache.dtype):
        return v
    blocks, block_size, kv_heads, head_dim = v.shape
    return v.view(blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def store(logical: torch.Tensor) -> torch.Tensor:
    """A cache in this dtype's storage layout holding ``logical``'s keys and values, given
    token-major (``[2, blocks, block_size, kv_heads, head_dim]``): tests and benches build a
    cache's content token-major and store it with this."""
    if not values_transposed(logical.dtype):
        return logical.clone()
    out = torch.empty_like(logical)
    out[0] = logical[0]
    values(out).copy_(logical[1])
    return out


def logical(kv_cache: torch.Tensor) -> torch.Tensor:
    """The inverse of ``store``: a token-major copy of a cache's keys and values."""
    if not values_transposed(kv_cache.dtype):
        return kv_cache.clone()
    return torch.stack((kv_cache[0], values(kv_cache).contiguous()))
