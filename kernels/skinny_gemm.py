"""What the decode-shape ("skinny") low-precision GEMMs share: row buckets, per-bucket tile
lists autotuned on the device (``Tuner``), and the self-cleaning split-K workspace.

Why: at decode a projection of M = 1..128 rows is bound by reading its weight once, so its
kernel must keep enough bytes in flight on every SM (132 on an H200) to reach the copy
bandwidth (~4.3 TB/s). Which tile does that (how many output columns a program owns, how many
bytes of each weight row it loads per step, how many warps and pipeline stages, whether K is
split over programs) depends on M, N, K and the chip, and was measured to matter 3-10x on the
H200 (issue 32: a fixed tile read FP8 weights at 0.2-0.4 TB/s). So each kernel has a compact
list of candidate tiles per row bucket, and ``triton.autotune`` (keyed on the bucket, N and K)
times them at the first call of each key (the engine's warm-up, before CUDA-graph capture:
the decode graphs run each batch size eagerly first). A call inside a graph capture whose key
was never tuned takes the bucket's first tile instead of timing (timing syncs the device).

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

from kernels.host import cdiv
from kernels.triton_flash import INTERPRETED

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_ROWS = M_BUCKETS[-1]        # the decode range the buckets are tuned for
LARGE = 2 * MAX_ROWS            # the bucket of every larger input (tests, benchmarks)


def m_bucket(m: int) -> int:
    """The smallest bucket holding m rows; LARGE above MAX_ROWS."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return LARGE


@dataclasses.dataclass(frozen=True)
class Tile:
    """One candidate launch: BLOCK_M rows x BLOCK_N output columns per program, BLOCK_K of K
    per step, ``split`` programs along K, and tl.dot (tensor cores) or FMA reductions."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: int = 1
    dot: bool = True

    @property
    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "SPLIT_K": self.split, "USE_DOT": self.dot}

    def config(self) -> triton.Config:
        return triton.Config(self.meta, num_warps=self.warps, num_stages=self.stages)

    @classmethod
    def of(cls, config: triton.Config) -> "Tile":
        kw = config.kwargs
        return cls(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps,
                   config.num_stages, kw["SPLIT_K"], kw["USE_DOT"])


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _bench(fn, quantiles=None):
    """The autotuner's timing: triton's do_bench (L2 flushed before each call) kept short,
    since the engine tunes every (bucket, shape) at start-up; under the CPU interpreter one
    timed call (tests)."""
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
    """A skinny kernel autotuned per (M_BUCKET, N, K) over ``tiles[bucket]`` (those ``fits``
    allows for the call's arguments). The kernel takes M_BUCKET, N, K, SPLIT_K and the Tile's
    constexprs (BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT) and runs on grid (M / BLOCK_M, N / BLOCK_N,
    SPLIT_K)."""

    def __init__(self, kernel, tiles: dict[int, list[Tile]],
                 fits: Callable[[Tile, dict], bool] = lambda tile, args: True):
        self.kernel, self.tiles, self.fits = kernel, tiles, fits
        configs = list(dict.fromkeys(t for ts in tiles.values() for t in ts))
        self.tuned = triton.autotune([t.config() for t in configs], key=["M_BUCKET", "N", "K"],
                                     prune_configs_by={"early_config_prune": self._prune},
                                     do_bench=lambda fn, quantiles=None: _bench(fn, quantiles)
                                     )(kernel)
        self.seen: set[tuple] = set()

    def _prune(self, configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        allowed = set(self.candidates(args["M_BUCKET"], args))
        return [c for c in configs if Tile.of(c) in allowed]

    def candidates(self, bucket: int, args: dict) -> list[Tile]:
        fitting = [t for t in self.tiles[bucket] if self.fits(t, args)]
        if not fitting:
            raise ValueError(f"no tile of bucket {bucket} fits these arguments")
        return fitting

    def chosen(self) -> Tile | None:
        """The tile of the last autotuned launch (None before any)."""
        config = getattr(self.tuned, "best_config", None)
        return None if config is None else Tile.of(config)

    def __call__(self, m: int, n: int, args: dict, key: tuple, tile: Tile | None = None) -> None:
        """Launches for an [m, n] output; ``args`` name every kernel argument but the tile's;
        ``key`` identifies the shape and dtypes (capture falls back when it was never tuned);
        ``tile`` forces one launch configuration (tests, benchmark sweeps)."""
        if tile is None and (capturing(args["X"].device) and key not in self.seen
                             or len(self.candidates(args["M_BUCKET"], args)) == 1):
            tile = self.candidates(args["M_BUCKET"], args)[0]
        if tile is not None:
            self.kernel[_grid(m, n)(tile.meta)](**args, **tile.meta, num_warps=tile.warps,
                                                num_stages=tile.stages)
            return
        self.tuned[_grid(m, n)](**args)
        self.seen.add(key)
