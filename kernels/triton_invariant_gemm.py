"""A batch-invariant Triton GEMM for ``--deterministic``: ``x @ weight.T (+ bias)`` whose every
output row has the same bits whatever the number of rows, their order or their values.

Why the default path is not: ``kernels.linear`` sends 1-16 rows to the skinny kernel of
``headrace.kernels.triton_linear`` and more to cuBLAS, whose heuristics pick another tile shape, tensor
core instruction and split-K for each row count; a row's K reduction then runs in another order
(and on other instructions) at another batch size, and its rounding differs (Thinking
Machines, "Defeating Nondeterminism in LLM Inference", 2025).

Here the reduction order of an output element is a function of the layer's shape (N, K) only:

* one launch tile per shape (``Tile``: BLOCK_M x BLOCK_N outputs a program, BLOCK_K of K a
  step, warps, stages) for every row count: the same tl.dot instruction sequence per element;
* K is cut into fixed slices of ``slice_k`` elements (a multiple of BLOCK_K). Each slice is
  summed from zero over its BLOCK_K steps, then the slices' float32 sums are added in order,
  ``((0 + s0) + s1) + ...``, then the bias; then the cast.

How the slices run is a scheduling choice that changes no bit: when the output has few tiles
(a decode's few rows: too few programs to stream the weight at full bandwidth), each slice is
a program of its own (``split``), writes its float32 sum to a workspace, and the tile's last
program (a per-tile counter; release / acquire ordering, as ``headrace.kernels.skinny_gemm``'s split K)
adds them in slice order and stores the tile; otherwise (prefill, large decode batches) one
program walks every slice of its tile and keeps the running sum in a second accumulator.
Either way the same additions happen in the same order. The launch disables FMA contraction
(``enable_fp_fusion=False``) so that the slice and bias additions compile alike in both.

Which tile runs: the K slices are chosen once per shape (``tile_for``: slices long enough for
the decode batch to keep ~2 programs an SM streaming); they alone fix the bits on the H100,
whose tensor cores gave every tile height, width, K step, warp and stage count the same bits
(``bench/det_kernels.py --parts probe``, session 28), so there the tile's other dimensions
may follow the row count (``HOPPER_ROW_TILES``: 16-row tiles for a decode's few rows, 128 x 128
for a prefill's; served once verified on the GPU: ``ROW_TILES``). Until then, what it gives up: the tile is chosen once per shape, not per row
count, so a one-row decode computes a 64-row tile (the weight read dominates there) and a
large prefill runs this tile instead of cuBLAS's best; ``bench/det_kernels.py`` measures both
against cuBLAS and sweeps the tiles (``PINNED`` holds the winners per shape and device).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from headrace.kernels.host import cdiv
from headrace.kernels.skinny_gemm import Workspace, sm_count
from headrace.kernels.triton_flash import INTERPRETED

MIN_SLICE = 256            # K elements a slice at least (decode-size programs stream >= 32 KB)
PROGRAMS_PER_SM = 2        # programs a decode-size GEMM wants in flight an SM


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 4
    slice_k: int = 0       # K elements a slice (a multiple of block_k); 0: K itself (one slice)

    def slices(self, k: int) -> int:
        return 1 if self.slice_k <= 0 else cdiv(k, self.slice_k)


# (n, k, SM count) -> Tile: the winners of bench/det_kernels.py's sweep on a device (empty:
# ``tile_for``'s rule everywhere). A pinned tile changes the outputs' bits (not whether they
# are batch-invariant): pin before serving, not between runs that must agree.
PINNED: dict[tuple[int, int, int], Tile] = {}

# ((most rows, tile changes), ...): on the H100 ``bench/det_kernels.py --parts probe`` found a
# row's bits to depend on the K slices alone (every tile height, width, K step, warp count and
# stage count gave the 64 x 64 tile's bits on all ten Qwen3 / Llama shapes; session 28), so a
# launch there may take its tile from its row count, the shape's K slices kept: a decode's few
# rows a 16-row tile, a prefill's or a large batch's 128 x 128 tiles (cuBLAS's shape there).
HOPPER_ROW_TILES = ((16, {"block_m": 16}), (64, {}),
                    (1 << 62, {"block_m": 128, "block_n": 128, "warps": 8, "stages": 3}))
# SM count -> the row tiles serving uses. Empty until this exact table has passed
# ``tests/test_batch_invariant_triton.py::test_row_tiles_keep_every_rows_bits`` on the GPU (the
# probe changed one dimension at a time; that test runs the table's tiles at 1-2,048 rows):
# then ``{132: HOPPER_ROW_TILES}`` (H100 and H200 have 132 SMs). Meanwhile: one tile a shape.
ROW_TILES: dict[int, tuple[tuple[int, dict], ...]] = {}


def row_tile(tile: Tile, m: int, sms: int) -> Tile:
    """``tile`` (a shape's) for a launch of ``m`` rows: its K slices, the rest by ``ROW_TILES``."""
    for most, changes in ROW_TILES.get(sms, ()):
        if m <= most:
            return dataclasses.replace(tile, **changes) if changes else tile
    return tile


def tile_for(n: int, k: int, sms: int, element_size: int = 2) -> Tile:
    """The one tile of an [n, k] weight on a device of ``sms`` SMs: 64 rows a program (a
    wgmma instruction's height), 128 output columns where the columns alone give every SM
    ``PROGRAMS_PER_SM`` programs, else 64; K sliced so that a decode's one row tile gets that
    many programs (slices of at least MIN_SLICE, whole BLOCK_K steps). float32 inputs (tests,
    CPU-sized models) take 32-wide K steps and two stages (shared memory)."""
    pinned = PINNED.get((n, k, sms))
    if pinned is not None:
        return pinned
    wide = element_size > 2
    block_k, stages = (32, 2) if wide else (64, 4)
    target = PROGRAMS_PER_SM * sms
    block_n = 128 if cdiv(n, 128) >= target and not wide else 64
    tiles_n = cdiv(n, block_n)
    if tiles_n >= target or k <= MIN_SLICE:
        return Tile(64, block_n, block_k, 4, stages, 0)
    wanted = cdiv(target, tiles_n)
    slice_k = max(MIN_SLICE, cdiv(cdiv(k, wanted), block_k) * block_k)
    return Tile(64, block_n, block_k, 4, stages, 0 if slice_k >= k else slice_k)


@triton.jit
def _slice_sum(X, W, rows, cols, row_ok, col_ok, k_lo, k_hi, stride_xm, stride_wn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """sum over k in [k_lo, k_hi) of x[rows, k] * w[cols, k], from zero, BLOCK_K at a time:
    [BLOCK_M, BLOCK_N] float32."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + k, mask=row_ok[:, None] & (k < k_hi),
                    other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + k, mask=col_ok[:, None] & (k < k_hi),
                    other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemm_kernel(X, W, B, OUT, WS, CNT, M, N, K, SLICE_K, NUM_SLICES, stride_xm, stride_wn,
                 stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_F32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT:   # this program: slice program_id(2); the tile's last program adds them in order
        s = tl.program_id(2)
        part = _slice_sum(X, W, rows, cols, row_ok, col_ok, s * SLICE_K,
                          tl.minimum(K, (s + 1) * SLICE_K), stride_xm, stride_wn, BLOCK_M,
                          BLOCK_N, BLOCK_K, PRECISION, DOT_F32)
        ws = WS + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(ws + s.to(tl.int64) * M * N, part, mask=ok)
        tl.debug_barrier()      # every thread's partial sum before the counter's release
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
        if done == NUM_SLICES - 1:
            tl.debug_barrier()
            for j in range(0, NUM_SLICES):
                total = total + tl.load(ws + j * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(CNT + tile, 0)
            if HAS_BIAS:
                total = total + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out, total.to(OUT.dtype.element_ty), mask=ok)
    else:       # every slice here, in order, the running sum in a second accumulator
        for s in range(0, NUM_SLICES):
            total = total + _slice_sum(X, W, rows, cols, row_ok, col_ok, s * SLICE_K,
                                       tl.minimum(K, (s + 1) * SLICE_K), stride_xm, stride_wn,
                                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, DOT_F32)
        if HAS_BIAS:
            total = total + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, total.to(OUT.dtype.element_ty), mask=ok)


WORKSPACE = Workspace()    # the split slices' partial sums and tile counters (its own buffers)


def splits(tile: Tile, m: int, n: int, k: int, sms: int) -> bool:
    """Whether the slices run as programs of their own for an [m, n] output (a scheduling
    choice: the bits are the same either way): when that reads the weight (plus the slices'
    float32 partial sums, written and read back) sooner than the folded launch's fewer
    programs do, in bytes over the share of ``PROGRAMS_PER_SM`` programs an SM each keeps
    busy. So a decode's few rows split, a prefill's (or 256 decodes') thousands do not."""
    slices = tile.slices(k)
    if slices == 1:
        return False
    programs, target = cdiv(m, tile.block_m) * cdiv(n, tile.block_n), PROGRAMS_PER_SM * sms
    weight = 2.0 * n * k
    folded = weight / min(1.0, programs / target)
    split = (weight + 8.0 * m * n * slices) / min(1.0, programs * slices / target)
    return split < folded


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           tile: Tile | None = None, split: bool | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., K], batch-invariant (module docstring). ``tile`` /
    ``split``: force a launch (tests, the bench's sweep)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        out.copy_((bias if bias is not None else out.new_zeros(n)).expand(m, n))
        return out.view(*x.shape[:-1], n)
    sms = sm_count(x.device)
    if tile is None:
        tile = tile_for(n, k, sms, x.element_size())
        if x.is_cuda and not INTERPRETED and x.element_size() == 2:   # (probed on the GPU only)
            tile = row_tile(tile, m, sms)
    num_slices = tile.slices(k)
    slice_k = tile.slice_k if num_slices > 1 else cdiv(k, tile.block_k) * tile.block_k
    split = splits(tile, m, n, k, sms) if split is None else (split and num_slices > 1)
    tiles = (cdiv(m, tile.block_m), cdiv(n, tile.block_n))
    if split:
        ws, cnt = WORKSPACE.get(x.device, num_slices * m * n, tiles[0] * tiles[1])
    else:
        ws = cnt = out
    dot_f32 = INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or dot_f32 else "tf32"
    _gemm_kernel[(*tiles, num_slices if split else 1)](
        x2, weight, bias if bias is not None else weight, out, ws, cnt, m, n, k, slice_k,
        num_slices, x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        SPLIT=split, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PRECISION=precision, DOT_F32=dot_f32, num_warps=tile.warps, num_stages=tile.stages,
        enable_fp_fusion=False)
    return out.view(*x.shape[:-1], n)

