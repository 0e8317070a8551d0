"""Which kernel runs a quantized linear, per scheme, weight shape and row count: the
``--quant-backend`` flag and the table of winners measured on the device.

Pure Python (no torch). Schemes and their kernels (``headrace.kernels.quant_libs`` says what each
library kernel takes and which package it needs):

=========  =================================================================================
fp8        ``fp8_skinny`` (Triton W8A16, ``headrace.kernels.triton_fp8_linear``), ``fp8_w8a8`` (Triton
           W8A8 on the FP8 tensor cores, ``headrace.kernels.triton_fp8_w8a8``), ``fp8_w8a8_inline``
           (the same quantising its own rows per 128 columns, ``kernels.
           triton_fp8_w8a8_inline``: for layers whose rows nobody quantised), ``scaled_mm`` (Triton
           per-token activation quantiser + ``torch._scaled_mm``, W8A8), ``gemlite_fp8``
           (gemlite's FP8 weight-only GEMV/GEMM), ``fbgemm_rowwise`` (FBGEMM GenAI's
           row-wise W8A8 ``f8f8bf16_rowwise``)
w4a16,     ``triton_skinny`` (``headrace.kernels.triton_w4a16``), ``triton_tiled`` (4-bit, on a repacked
           copy of the weight: ``headrace.kernels.triton_w4a16_tiled``), ``triton`` (``headrace.kernels.triton_quant``'s
           general dequantise-and-dot kernel: any group layout, prefill sizes), ``tinygemm``
           (torch's built-in ``_weight_int4pack_mm``), ``gemlite``, ``fbgemm_i4`` (FBGEMM
w8a16      GenAI's preshuffled CUTLASS ``bf16i4bf16_shuffled``); 4-bit kernels rank in w4a16,
           8-bit ones in w8a16 (tinygemm and FBGEMM take 4-bit layers only)
=========  =================================================================================

``--quant-backend``: ``triton`` runs our kernels (``fp8_skinny`` / ``triton_skinny`` up to
``MAX_ROWS`` rows, ``scaled_mm`` / ``triton`` above; this is also every default below);
``torch``, ``gemlite`` and ``fbgemm`` run that family's kernel wherever it takes the layer;
``auto`` (default) takes, per row bucket, the fastest kernel the table ranks for the layer's
shape among those installed and able to take the layer, and the defaults for shapes the table
does not hold. The table (``quant_dispatch.json`` beside this file) is
``bench/quant_kernels.py --table``'s output, kept in the repository once measured:
``{"rankings": {scheme: {"NxK": {"M": [kernel, ...fastest first]}}}, "tiles": {scheme:
{"NxK": {"bucket": [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split, dot]}}}, "device": ...}``
(the tiles of ``fp8_w8a8``, ``fp8_w8a8_inline`` and ``triton_tiled`` under their own keys,
beside ``fp8_skinny``'s under ``fp8`` and ``triton_skinny``'s under ``w4a16``);
a row bucket reads the ranking measured at the smallest M at or above it (the largest M
otherwise). ``tiles`` pins the skinny kernels' launch per scheme, shape and row bucket (the
bench's sweep winners; ``headrace.kernels.skinny_gemm`` computes a tile for the others).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import pathlib
from typing import Callable

BACKENDS = ("auto", "triton", "torch", "gemlite", "fbgemm")
SCHEMES = ("fp8", "w4a16", "w8a16")
_INTEGER = ("triton_skinny", "triton_tiled", "triton", "tinygemm", "gemlite", "fbgemm_i4")
KERNELS = {"fp8": ("fp8_skinny", "fp8_w8a8", "fp8_w8a8_inline", "scaled_mm", "gemlite_fp8",
                   "fbgemm_rowwise"),
           "w4a16": _INTEGER, "w8a16": _INTEGER}
FAMILY = {"fp8_skinny": "triton", "fp8_w8a8": "triton", "fp8_w8a8_inline": "triton",
          "scaled_mm": "triton",
          "triton_skinny": "triton", "triton_tiled": "triton",
          "triton": "triton", "tinygemm": "torch", "gemlite_fp8": "gemlite", "gemlite": "gemlite",
          "fbgemm_rowwise": "fbgemm", "fbgemm_i4": "fbgemm"}
# torch's family runs _scaled_mm for FP8 at every size
FAMILY_FP8 = {"triton": None, "torch": "scaled_mm", "gemlite": "gemlite_fp8",
              "fbgemm": "fbgemm_rowwise"}
FAMILY_WNA16 = {"triton": None, "torch": "tinygemm", "gemlite": "gemlite", "fbgemm": "fbgemm_i4"}
# headrace.kernels.skinny_gemm's row buckets, then 129..256 and prefill sizes (> 256)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 8192)
MAX_ROWS = 128
ALWAYS = ("fp8_skinny", "fp8_w8a8", "fp8_w8a8_inline", "scaled_mm", "triton")   # take every layer of their scheme
# kernels that run on a copy of the weight in a layout of their own, made at the layer's plan
# (FBGEMM's row-wise FP8 GEMM reads the e4m3 weight as it is)
OWN_LAYOUT = ("tinygemm", "gemlite", "gemlite_fp8", "fbgemm_i4", "triton_tiled")
TILE_KEYS = SCHEMES + ("fp8_w8a8", "fp8_w8a8_inline", "triton_tiled")   # the pinned tiles' keys: a scheme, or a second kernel's
TABLE_PATH = pathlib.Path(__file__).with_name("quant_dispatch.json")
# HEADRACE_QUANT_AUTOTUNE=1: our skinny kernels (headrace.kernels.skinny_gemm) and gemlite time their
# tiles per shape at first use instead of the pinned / fixed ones (minutes at start-up)
AUTOTUNE = os.environ.get("HEADRACE_QUANT_AUTOTUNE", "0") not in ("", "0")


def bucket_of(m: int) -> int:
    return BUCKETS[min(bisect.bisect_left(BUCKETS, m), len(BUCKETS) - 1)]


def default(scheme: str, bucket: int, skinny: bool = True) -> str:
    """The Triton family's kernel: the skinny GEMM up to MAX_ROWS rows (when it takes the
    layer), the large-M kernel above."""
    if scheme == "fp8":
        return "fp8_skinny" if bucket <= MAX_ROWS else "scaled_mm"
    return "triton_skinny" if skinny and bucket <= MAX_ROWS else "triton"


def resolve_backend(backend: str, device_type: str, why_not: Callable[[str], str | None]) -> str:
    """Checks ``--quant-backend`` at start-up: a library backend needs a CUDA device and its
    package (``why_not(library)``: why it cannot run, None when it can); ValueError otherwise,
    naming the package to install; a HEADRACE_QUANT_LAYOUTS that is not a number or ``all``
    is refused here too, before any layer plans. Returns the backend."""
    if backend not in BACKENDS:
        raise ValueError(f"--quant-backend {backend!r}: choose from {', '.join(BACKENDS)}")
    layout_budget()
    if backend in ("auto", "triton"):
        return backend
    if device_type != "cuda":
        raise ValueError(f"--quant-backend {backend}: its kernels need a CUDA device (--device "
                         f"{device_type}); use --quant-backend auto or triton")
    reason = why_not(backend)
    if reason is not None:
        raise ValueError(f"--quant-backend {backend}: {reason}")
    return backend


def load_table(path: str | pathlib.Path | None = None) -> dict:
    """The measured rankings ({} when the file is absent: every layer takes the defaults)."""
    path = pathlib.Path(path) if path is not None else TABLE_PATH
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    rankings = data.get("rankings", {})
    for scheme, shapes in rankings.items():
        if scheme not in SCHEMES:
            raise ValueError(f"{path}: unknown scheme {scheme!r}")
        for shape, by_m in shapes.items():
            for m, ranked in by_m.items():
                unknown = [k for k in ranked if k not in KERNELS[scheme]]
                if unknown or not str(m).isdigit():
                    raise ValueError(f"{path}: {scheme} {shape} M={m}: unknown kernels {unknown}")
    return rankings


def load_tiles(path: str | pathlib.Path | None = None) -> dict:
    """The pinned skinny-kernel tiles ({} when the file or its "tiles" are absent)."""
    path = pathlib.Path(path) if path is not None else TABLE_PATH
    if not path.exists():
        return {}
    tiles = json.loads(path.read_text()).get("tiles", {})
    for scheme, shapes in tiles.items():
        for shape, by_bucket in shapes.items():
            for bucket, tile in by_bucket.items():
                if (scheme not in TILE_KEYS or not str(bucket).isdigit() or len(tile) not in (7, 8)
                        or not all(isinstance(v, int) and v >= 0 for v in tile)):
                    raise ValueError(f"{path}: tile {scheme} {shape} bucket {bucket}: {tile!r} "
                                     f"is not [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split, dot"
                                     f"(, pipe)]")
    return tiles


_TABLE: dict | None = None
_TILES: dict | None = None


def table() -> dict:
    global _TABLE
    if _TABLE is None:
        _TABLE = load_table()
    return _TABLE


def pinned_tile(scheme: str, n: int, k: int, bucket: int) -> list[int] | None:
    """The tile the table pins for a skinny kernel of ``scheme`` at this shape and row bucket."""
    global _TILES
    if _TILES is None:
        _TILES = load_tiles()
    return _TILES.get(scheme, {}).get(f"{n}x{k}", {}).get(str(bucket))


def ranking(rankings: dict, scheme: str, n: int, k: int, bucket: int) -> list[str]:
    """The kernels measured for this shape at the smallest M >= bucket (fastest first)."""
    by_m = rankings.get(scheme, {}).get(f"{n}x{k}")
    if not by_m:
        return []
    measured = sorted(int(m) for m in by_m)
    at = next((m for m in measured if m >= bucket), measured[-1])
    return list(by_m[str(at)])


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layer's kernel per row bucket."""

    by_bucket: tuple[tuple[int, str], ...]

    @functools.cached_property
    def _lookup(self) -> dict[int, str]:
        return dict(self.by_bucket)

    def kernel(self, m: int) -> str:
        return self._lookup[bucket_of(m)]

    @property
    def kernels(self) -> set[str]:
        return {name for _, name in self.by_bucket}

    def describe(self) -> str:
        return ", ".join(f"{_rows(b)}: {name}" for b, name in self.by_bucket)


def _rows(bucket: int) -> str:
    """A bucket's rows as text: '16', '129-256', '>256'."""
    below = BUCKETS[BUCKETS.index(bucket) - 1] if bucket != BUCKETS[0] else 0
    if bucket <= MAX_ROWS:
        return str(bucket)
    return f">{below}" if bucket == BUCKETS[-1] else f"{below + 1}-{bucket}"


def plan(scheme: str, n: int, k: int, backend: str, takes: Callable[[str], bool],
         rankings: dict | None = None, max_layouts: int | None = None) -> Plan:
    """The kernels of a layer of ``scheme`` with an [n, k] weight. ``takes(kernel)``: whether
    that kernel can run this layer here (its library installed; its layout, dtype and group
    constraints met); asked for ``triton_skinny`` and the library kernels (``fp8_skinny``,
    ``scaled_mm`` and ``triton`` take every layer). ``max_layouts`` (None: no limit; a layer
    passes ``layout_budget()``): the most kernels of ``OWN_LAYOUT`` a plan may use,
    since each holds the weight once more; beyond it, ``auto`` keeps those that run the most
    row buckets and gives the others' buckets to the next kernel of their ranking."""
    if backend not in BACKENDS:
        raise ValueError(f"--quant-backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}")

    def usable(name: str) -> bool:
        return name in ALWAYS or takes(name)

    skinny = scheme == "fp8" or usable("triton_skinny")
    family = (FAMILY_FP8 if scheme == "fp8" else FAMILY_WNA16).get(backend)
    rankings = table() if rankings is None else rankings
    budget = max_layouts

    def choose(b: int, allowed: Callable[[str], bool]) -> str:
        name = default(scheme, b, skinny)
        if backend == "auto":
            name = next((r for r in ranking(rankings, scheme, n, k, b)
                         if usable(r) and allowed(r)), name)
        elif family is not None and usable(family):
            name = family
        return name

    chosen = [(b, choose(b, lambda name: True)) for b in BUCKETS]
    won = {}                     # each kernel with a layout of its own -> the buckets it runs
    for b, name in chosen:
        if name in OWN_LAYOUT:
            won.setdefault(name, []).append(b)
    if budget is not None and len(won) > budget:
        # the layouts that run the most row buckets (ties: the one reaching the fewest rows)
        kept = set(sorted(won, key=lambda name: (-len(won[name]), won[name][0]))[:budget])
        chosen = [(b, name if name not in OWN_LAYOUT or name in kept else
                   choose(b, lambda r: r not in OWN_LAYOUT or r in kept)) for b, name in chosen]
    return Plan(tuple(chosen))


def layout_budget() -> int | None:
    """HEADRACE_QUANT_LAYOUTS: how many layouts of its weight besides the checkpoint's a
    quantized layer may hold (``OWN_LAYOUT``'s kernels: one copy each); default 1, ``all``
    for no limit."""
    value = os.environ.get("HEADRACE_QUANT_LAYOUTS", "1").strip()
    if value == "all":
        return None
    if not value.isdigit():
        raise ValueError(f"HEADRACE_QUANT_LAYOUTS={value!r}: a number of layouts (0, 1, 2, ...) "
                         f"or 'all'")
    return int(value)
