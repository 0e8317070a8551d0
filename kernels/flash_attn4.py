"""Prefill attention through flash-attn-4 (``flash_attn.cute.interface.flash_attn_varlen_func``,
CuTe DSL, compiled just in time), reading our paged KV cache in place.

Our cache is ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer, so ``kv_cache[0]``
and ``kv_cache[1]`` are exactly flash-attn-4's paged ``k``/``v`` layout
``(num_pages, page_size, nheads_k, head_dim)`` and our block tables (int32, one row per
sequence) are its ``page_table``; ``seqused_k`` is our ``seq_lens`` and ``cu_seqlens_q`` our
``query_start_loc``. Its causal mask is bottom-right aligned (query i of a q_len-token chunk sees
keys up to seqused_k - q_len + i), which is our chunked-prefill semantics over a cached prefix.
Any page size works on SM90: a page of exactly the kernel's key tile (128 tokens at head_dim
128) loads by TMA, other sizes (our 16) by cp.async, ~10% slower (issue 24's H200 figures:
580-630 against 630-684 TFLOP/s at 8k-32k). So the 16-token blocks stay, and ``--block-size
128`` (the whole engine takes it) is the knob that buys that 10%: a prefix-cache hit then
reuses whole 128-token blocks only (on average 64 tokens of a shared prefix recomputed per hit,
against 8) and every running sequence leaves ~64 slots of its last block unused (W1's 256
sequences: ~16k tokens of KV, against ~2k). The TMA path reads whole pages, so the rows of a
sequence's last page past its length must hold finite values (our cache is zeroed at
allocation and only ever holds written K/V).

The ``Plan`` is made once per step (``plan``: views of the step's metadata, plus one tiny
device subtraction for mixed steps) and shared by every layer, so a layer's call costs only
flash-attn-4's own host work. In a mixed step the decodes (the first ``num_decodes`` rows)
take the decode kernel passed in (Triton's, split over the context) and flash-attn-4 the rest.
Not supported by flash-attn-4 here, hence by ``unusable``: CPU, float32, an FP8 KV cache
(its FP8 path is SM100-only), GPUs without its paged path (below SM90, SM120).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from headrace.kernels.attention_policy import FLASH, INSTALL_HINT, PACKAGE, prefill_pairs

_varlen: Callable | None = None


def load() -> Callable:
    """``flash_attn_varlen_func`` (imported once); ImportError when the package is missing."""
    global _varlen
    if _varlen is None:
        from flash_attn.cute.interface import flash_attn_varlen_func
        _varlen = flash_attn_varlen_func
    return _varlen


def unusable(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
             head_dim: int) -> str | None:
    """Why flash-attn-4 cannot run this model's attention on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"{PACKAGE} needs a CUDA device, not {device.type}"
    try:
        load()
    except Exception as exc:   # ImportError, or a broken install failing inside cutlass
        return (f"the {PACKAGE} package is not installed or does not import ({INSTALL_HINT}): "
                f"{type(exc).__name__}: {exc}")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):
        return f"{PACKAGE}'s paged KV needs an SM90/SM100 GPU, this is sm_{major}{minor}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{PACKAGE} needs bfloat16 or float16, the model runs in {dtype}"
    if kv_dtype != dtype:
        return f"{PACKAGE} does not read a {kv_dtype} KV cache on this GPU (--kv-cache-dtype auto)"
    top = 256 if major == 9 else 128
    if not (8 <= head_dim <= top and head_dim % 8 == 0):
        return f"{PACKAGE} supports head_dim 8..{top} in steps of 8 on sm_{major}x, not {head_dim}"
    return None


@dataclasses.dataclass
class Plan:
    """One step's flash-attn-4 arguments, shared by every layer. The prefill part is the
    sequences from ``num_decodes`` on, whose query rows start at row ``num_decodes``."""

    num_decodes: int
    cu_seqlens_q: torch.Tensor   # [prefill seqs + 1] int32, from 0
    seqused_k: torch.Tensor      # [prefill seqs] int32
    page_table: torch.Tensor     # [prefill seqs, max_blocks] int32
    max_seqlen_q: int
    decode_meta: tuple = ()      # (query_start_loc, seq_lens, block_tables) of the decodes


def plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
         num_decodes: int, max_query_len: int) -> Plan:
    """The step's plan from our metadata (int32 device tensors; see AttentionMetadata)."""
    nd = num_decodes
    cu = query_start_loc if nd == 0 else query_start_loc[nd:] - nd
    decode_meta = ((query_start_loc[:nd + 1], seq_lens[:nd], block_tables[:nd]) if nd else ())
    return Plan(nd, cu, seq_lens[nd:], block_tables[nd:], max_query_len, decode_meta)


def varlen_kwargs(query: torch.Tensor, kv_cache: torch.Tensor, p: Plan, scale: float) -> dict:
    """The arguments of the prefill part's ``flash_attn_varlen_func`` call."""
    return dict(q=query[p.num_decodes:], k=kv_cache[0], v=kv_cache[1], cu_seqlens_q=p.cu_seqlens_q,
                seqused_k=p.seqused_k, page_table=p.page_table, max_seqlen_q=p.max_seqlen_q,
                softmax_scale=scale, causal=True)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, p: Plan, scale: float,
                    decode: Callable, decode_order: torch.Tensor | None = None,
                    varlen: Callable | None = None) -> torch.Tensor:
    """Causal attention of the step (see headrace.kernels.reference.paged_attention): flash-attn-4
    for the prefill part, ``decode(query, kv_cache, qsl, seq_lens, tables, scale, decode_only=True,
    decode_order=...)`` for the decodes. ``varlen`` replaces flash_attn_varlen_func (tests)."""
    result = (varlen or load())(**varlen_kwargs(query, kv_cache, p, scale))
    out = result[0] if isinstance(result, tuple) else result
    if not p.num_decodes:
        return out
    qsl, seq_lens, tables = p.decode_meta
    head = decode(query[:p.num_decodes], kv_cache, qsl, seq_lens, tables, scale,
                  max_query_len=1, decode_only=True, decode_order=decode_order)
    return torch.cat((head, out))


def step_plan(policy, prep, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor) -> Plan | None:
    """The step's plan when ``policy`` (a ``headrace.kernels.attention_policy.Policy``, or None:
    Triton) sends its prefill part to flash-attn-4, else None. ``prep``: the step's host arrays
    (``query_start_loc``, ``seq_lens``, ``num_decodes``, ``decode_only``, ``max_query_len``; a
    ``headrace.dataplane.input_batch.PreparedBatch``), the tensors their copies on the device.
    Called once per step, on the host."""
    if policy is None or not policy.uses_flash or prep.decode_only:
        return None
    pairs = prefill_pairs(prep.query_start_loc, prep.seq_lens, prep.num_decodes)
    if policy.choose(False, prep.num_decodes, pairs) != FLASH:
        return None
    return plan(query_start_loc, seq_lens, block_tables, prep.num_decodes, prep.max_query_len)


# flash-attn-4 compiles a second kernel variant for varlen batches of more than this many
# sequences (its BIN_BATCH_SEARCH_THRESH: a batch-lookup aid for the tile scheduler).
LOOKUP_BATCH = 256


def warm_up(cache: torch.Tensor, heads: int, dtype: torch.dtype, max_seqs: int) -> None:
    """Compiles (or loads from flash-attn-4's cache) every kernel variant a step can pick for
    this model: a one-sequence prefill and, when the worker holds more than LOOKUP_BATCH
    sequences, a batch past it, so no request pays a compilation. ``cache``: one layer's
    (zeroed) KV cache."""
    dev, head_dim, blocks, block = cache.device, cache.shape[-1], cache.shape[1], cache.shape[2]
    for batch in (1, LOOKUP_BATCH + 1) if max_seqs > LOOKUP_BATCH else (1,):
        q_len, width = (1, 1) if batch > 1 else (blocks * block, blocks)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len
        lens = torch.full((batch,), q_len, dtype=torch.int32, device=dev)
        tables = torch.arange(width, dtype=torch.int32, device=dev).repeat(batch, 1)
        query = torch.zeros((batch * q_len, heads, head_dim), dtype=dtype, device=dev)
        paged_attention(query, cache, plan(qsl, lens, tables, 0, q_len), head_dim ** -0.5, None)
