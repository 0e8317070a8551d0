"""What the decode-shape ("skinny") low-precision GEMMs share: row buckets, the launch tile
per (bucket, shape) (``Tuner``), and the self-cleaning split-K workspace.

Why: at decode a projection of M = 1..128 rows is bound by reading its weight once, so its
kernel must keep enough bytes in flight on every SM (132 on an H200) to reach the copy
bandwidth (~4.3 TB/s). Which tile does that (how many output columns a program owns, how many
bytes of each weight row it loads per step, how many warps and pipeline stages, whether K is
split over programs) depends on M, N, K and the chip, and was measured to matter 3-10x on the
H200 (issue 32: a fixed tile read FP8 weights at 0.2-0.4 TB/s).

Which tile runs (``Tuner.choose``), in order:

1. a tile pinned for (scheme, N, K, bucket) in ``kernels/quant_dispatch.json`` (``"tiles"``:
   the winners of ``bench/quant_kernels.py``'s sweep on the device, measured offline);
2. otherwise the bucket's first tile with K split by arithmetic (``split_for``): Little's law
   at 4.3 TB/s and ~1 us of memory latency wants ~4 MB in flight, ~32 KB an SM, and one
   program streams a [BLOCK_N, BLOCK_K] weight tile of ~8 KB a step (FP8 32 x 256 bytes, INT4
   128 columns x 64 bytes), so about ``PROGRAMS_PER_SM`` = 4 programs an SM; where the output
   tiles are fewer, K is split (2 or ``MAX_SPLIT`` = 4 slices, each at least two K tiles long,
   while the partial sums' bytes stay under half the weight's). A kernel's ``Tuner`` may set
   other limits per tile (``split_limits``), measured: the FP8 one-row and W8A8 tiles split
   only below 2 programs an SM, the issue-bound INT4 one-row tile up to 16 ways below 8;
3. with ``HEADRACE_QUANT_AUTOTUNE=1`` (``AUTOTUNE``), ``triton.autotune`` instead times the
   bucket's list per (bucket, N, K) at the first call of each key (minutes over a model's
   shapes: off by default, so a server starts without timing anything).

Without autotuning a (bucket, shape) costs a compile of its tile at most, shared across shapes
(N and K are runtime arguments). A call inside a graph capture never times (an autotuned key
not seen eagerly takes the fixed choice): timing would synchronise the device.

Split K: where a shape has few output tiles, programs also split K and add their float32
partial sums into a workspace; the program that finishes a tile last (a per-tile counter,
incremented after its partial sum with release/acquire ordering) reads the total, zeroes the
workspace tile and resets the counter, so the workspace is all zeros again when the kernel
ends. One launch, no memset and no cast kernel: the workspace is allocated once per device
(grown outside graph capture only; older buffers are kept, since captured graphs point at them)
and shared by every skinny GEMM, which is safe because kernels of one stream run one after
another.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import triton
import triton.language as tl

from headrace.kernels import quant_dispatch
from headrace.kernels.host import cdiv
from headrace.kernels.triton_flash import INTERPRETED

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_ROWS = M_BUCKETS[-1]        # the decode range the buckets are tuned for
LARGE = 2 * MAX_ROWS            # the bucket of every larger input (tests, benchmarks)
AUTOTUNE = quant_dispatch.AUTOTUNE   # HEADRACE_QUANT_AUTOTUNE=1
PROGRAMS_PER_SM = 4             # programs in flight an SM for the fixed tile (docstring)
MAX_SPLIT = 4
H200_SMS = 132                  # the interpreter's stand-in for the SM count


def m_bucket(m: int) -> int:
    """The smallest bucket holding m rows; LARGE above MAX_ROWS."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return LARGE


@dataclasses.dataclass(frozen=True)
class Tile:
    """One candidate launch: BLOCK_M rows x BLOCK_N output columns per program, BLOCK_K of K
    per step, ``split`` programs along K, tl.dot (tensor cores) or FMA reductions, and for FMA
    ``pipe``: the kernel's pipelined program, where it has one (headrace.kernels.triton_fp8_linear)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: int = 1
    dot: bool = True
    pipe: bool = False

    @property
    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "SPLIT_K": self.split, "USE_DOT": self.dot, "PIPE": self.pipe}

    def config(self) -> triton.Config:
        return triton.Config(self.meta, num_warps=self.warps, num_stages=self.stages)

    @classmethod
    def of(cls, config: triton.Config) -> "Tile":
        kw = config.kwargs
        return cls(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps,
                   config.num_stages, kw["SPLIT_K"], kw["USE_DOT"], kw.get("PIPE", False))

    def as_list(self) -> list:
        """[BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split, dot(, pipe when set)]: the form
        of quant_dispatch.json's tiles."""
        return [self.block_m, self.block_n, self.block_k, self.warps, self.stages, self.split,
                int(self.dot)] + ([1] if self.pipe else [])

    @classmethod
    def from_list(cls, values) -> "Tile":
        *ints, dot = values[:7]
        return cls(*(int(v) for v in ints), dot=bool(dot), pipe=bool(values[7:] and values[7]))


def split_for(tile: Tile, bucket: int, n: int, k: int, sms: int, bits: int = 8,
              per_sm: int = PROGRAMS_PER_SM, max_split: int = MAX_SPLIT) -> Tile:
    """``tile`` (unsplit) with K split in powers of two up to ``max_split`` ways while its
    programs are fewer than ``per_sm`` an SM, each K slice at least two BLOCK_K steps long and
    the float32 partial sums (added and read back) at most half the weight's bytes (``bits`` a
    weight)."""
    rows = min(bucket, MAX_ROWS)
    programs = cdiv(rows, tile.block_m) * cdiv(n, tile.block_n)
    split = 1
    while (programs * split < per_sm * sms and split < max_split
           and k >= 2 * split * 2 * tile.block_k and 2 * split * rows * 8 <= k * bits // 8):
        split *= 2
    return dataclasses.replace(tile, split=split)


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda" or not torch.cuda.is_available():
        return H200_SMS
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _bench(fn, quantiles=None):
    """The autotuner's timing (HEADRACE_QUANT_AUTOTUNE=1): triton's do_bench (L2 flushed
    before each call) kept short; under the CPU interpreter one timed call (tests)."""
    if INTERPRETED:
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return [ms, ms, ms] if quantiles else ms
    return triton.testing.do_bench(fn, warmup=3, rep=12, quantiles=quantiles)


class Workspace:
    """The split-K partial sums (float32, one per output element) and tile counters (int32),
    all zero between kernels; one per device."""

    def __init__(self):
        self.buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []   # graphs may point at them

    def get(self, device: torch.device, floats: int, counters: int):
        have = self.buffers.get(device)
        if have is None or have[0].numel() < floats or have[1].numel() < counters:
            if capturing(device):
                raise RuntimeError("a skinny GEMM's split-K workspace must grow during CUDA-graph "
                                   "capture: run the shape eagerly first (warm-up)")
            if have is not None:
                self.retired.append(have)
                floats, counters = max(floats, have[0].numel()), max(counters, have[1].numel())
            have = (torch.zeros(floats, dtype=torch.float32, device=device),
                    torch.zeros(counters, dtype=torch.int32, device=device))
            self.buffers[device] = have
        return have


WORKSPACE = Workspace()


def workspace(device: torch.device, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for any tile's split K of an [m, n] output (BLOCK_N >= 16 columns a tile)."""
    return WORKSPACE.get(device, m * n, m * cdiv(n, 16))


@triton.jit
def program_slice(K, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """A skinny program's rows and output columns (grid axes 0 and 1) and its K slice
    [k_lo, k_hi) (axis 2; whole BLOCK_K tiles a slice: empty past K)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(2) * k_per
    return rows, cols, k_lo, tl.minimum(K, k_lo + k_per)


@triton.jit
def store_or_reduce(acc, rows, cols, row_ok, col_ok, OUT, stride_om, WS, CNT, N, S, stride_s, B,
                    HAS_BIAS: tl.constexpr, SPLIT_K, APPLY_SCALE: tl.constexpr):
    """Epilogue of a skinny GEMM whose program holds acc [BLOCK_N, BLOCK_M] (output columns x
    rows, float32): stores acc (times the per-column scale when APPLY_SCALE; S float32, stride_s
    0: one scale) plus the bias in OUT's dtype, or, with K split, adds acc into the workspace
    and lets the tile's last program store the total."""
    ok = col_ok[:, None] & row_ok[None, :]
    if SPLIT_K > 1:
        ws = WS + rows[None, :].to(tl.int64) * N + cols[:, None]
        tl.atomic_add(ws, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()      # every thread's partial sum before the counter's release
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.atomic_add(ws, tl.zeros_like(acc), mask=ok, sem="acquire")
            tl.store(ws, tl.zeros_like(acc), mask=ok)
            tl.atomic_xchg(CNT + tile, 0)
            _store(total, rows, cols, ok, col_ok, OUT, stride_om, S, stride_s, B, HAS_BIAS,
                   APPLY_SCALE)
    else:
        _store(acc, rows, cols, ok, col_ok, OUT, stride_om, S, stride_s, B, HAS_BIAS, APPLY_SCALE)


@triton.jit
def _store(acc, rows, cols, ok, col_ok, OUT, stride_om, S, stride_s, B, HAS_BIAS: tl.constexpr,
           APPLY_SCALE: tl.constexpr):
    if APPLY_SCALE:
        acc = acc * tl.load(S + cols * stride_s, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out = OUT + rows[None, :].to(tl.int64) * stride_om + cols[:, None]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=ok)


def activations(x: torch.Tensor, k: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] as [M, K] with contiguous rows, its columns reordered by ``perm`` (act order)."""
    x2 = x.reshape(-1, k)
    if perm is not None:
        return x2.index_select(1, perm)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def launch_args(x2: torch.Tensor, out: torch.Tensor) -> dict:
    """The arguments every skinny kernel takes for x2 [M, K] -> out [M, N]: the output, the
    split-K workspace, the row bucket and the tl.dot precision (bfloat16 operands are widened
    to float32 under the interpreter)."""
    m, n = out.shape
    ws, cnt = workspace(x2.device, m, n)
    dot_f32 = INTERPRETED and x2.dtype == torch.bfloat16
    return dict(OUT=out, WS=ws, CNT=cnt, M=m, N=n, stride_xm=x2.stride(0), stride_om=out.stride(0),
                M_BUCKET=m_bucket(m), DOT_F32=dot_f32,
                PRECISION="ieee" if x2.dtype == torch.float32 or dot_f32 else "tf32")


def _grid(m: int, n: int):
    return lambda meta: (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]),
                         meta["SPLIT_K"])


class Tuner:
    """A skinny kernel's launch per (M_BUCKET, N, K): the pinned or fixed tile (``choose``), or
    with AUTOTUNE the fastest of ``tiles[bucket]`` (those ``fits`` allows for the call's
    arguments). The kernel takes M_BUCKET, N, K, SPLIT_K and the Tile's constexprs (BLOCK_M,
    BLOCK_N, BLOCK_K, USE_DOT) and runs on grid (M / BLOCK_M, N / BLOCK_N, SPLIT_K)."""

    def __init__(self, kernel, tiles: dict[int, list[Tile]],
                 fits: Callable[[Tile, dict], bool] = lambda tile, args: True,
                 split_limits: Callable[[Tile], tuple[int, int]] = lambda tile: (
                     PROGRAMS_PER_SM, MAX_SPLIT)):
        self.kernel, self.tiles, self.fits = kernel, tiles, fits
        self.split_limits = split_limits      # a tile's (programs an SM, most K slices)
        configs = list(dict.fromkeys(t for ts in tiles.values() for t in ts))
        self.tuned = triton.autotune([t.config() for t in configs], key=["M_BUCKET", "N", "K"],
                                     prune_configs_by={"early_config_prune": self._prune},
                                     do_bench=lambda fn, quantiles=None: _bench(fn, quantiles)
                                     )(kernel)
        self.seen: set[tuple] = set()
        self.fixed: dict[tuple, Tile] = {}

    def _prune(self, configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        allowed = set(self.candidates(args["M_BUCKET"], args))
        return [c for c in configs if Tile.of(c) in allowed]

    def candidates(self, bucket: int, args: dict) -> list[Tile]:
        fitting = [t for t in self.tiles[bucket] if self.fits(t, args)]
        if not fitting:
            raise ValueError(f"no tile of bucket {bucket} fits these arguments")
        return fitting

    def choose(self, scheme: str, args: dict, key: tuple) -> Tile:
        """The tile without timing: pinned in quant_dispatch.json for (scheme, N, K, bucket)
        when it fits, else the bucket's first unsplit tile with ``split_for``'s K split."""
        tile = self.fixed.get(key)
        if tile is None:
            bucket, n, k = args["M_BUCKET"], args["N"], args["K"]
            pinned = quant_dispatch.pinned_tile(scheme, n, k, bucket)
            tile = None if pinned is None else Tile.from_list(pinned)
            if tile is None or not self.fits(tile, args):
                first = next((t for t in self.candidates(bucket, args) if t.split == 1),
                             self.candidates(bucket, args)[0])
                tile = self.split(first, bucket, n, k, sm_count(args["X"].device),
                                  args.get("BITS", 8))
            self.fixed[key] = tile
        return tile

    def split(self, tile: Tile, bucket: int, n: int, k: int, sms: int, bits: int = 8) -> Tile:
        """``split_for`` with this kernel's limits for ``tile``."""
        return split_for(tile, bucket, n, k, sms, bits, *self.split_limits(tile))

    def chosen(self) -> Tile | None:
        """The tile of the last autotuned launch (None before any)."""
        config = getattr(self.tuned, "best_config", None)
        return None if config is None else Tile.of(config)

    def __call__(self, m: int, n: int, args: dict, key: tuple, tile: Tile | None = None,
                 scheme: str = "fp8") -> None:
        """Launches for an [m, n] output; ``args`` name every kernel argument but the tile's;
        ``key`` identifies the shape and dtypes; ``scheme`` names the pinned tiles' table;
        ``tile`` forces one launch configuration (tests, benchmark sweeps)."""
        if tile is None and AUTOTUNE and not (capturing(args["X"].device) and key not in self.seen) \
                and len(self.candidates(args["M_BUCKET"], args)) > 1:
            self.tuned[_grid(m, n)](**args)
            self.seen.add(key)
            return
        tile = tile or self.choose(scheme, args, key)
        self.kernel[_grid(m, n)(tile.meta)](**args, **tile.meta, num_warps=tile.warps,
                                            num_stages=tile.stages)
