"""Probe (GPU only, not a test): one decode layer's projection chain of Qwen3-0.6B, 28 layers of
distinct weights replayed from a CUDA graph, at W1's batch sizes:

    add+RMSNorm -> qkv -> o -> add+RMSNorm -> gate_up -> SiLU*mul -> down

(attention left out: o reads the q columns of qkv). Variants:

* cublas:   today's path (torch's GEMMs, kernels.triton_ops' norm and SiLU);
* triton:   Triton GEMMs with tiles picked per shape and batch by a sweep here;
* pdl:      the same kernels launched with programmatic dependent launch (each waits on its
            predecessor with griddepcontrol.wait and lets its successor launch at once);
* pdl+pf:   GEMMs first prefetch their weight slice into L2, then wait (weights never depend
            on the previous kernel, so their DRAM latency hides under its tail);
* fused:    pdl+pf, gate_up computes SiLU(gate)*up in its epilogue (no SiLU kernel) and o/down
            write float32 split-K partials that the add+RMSNorm after them sums.

    python -P bench/pdl_probe.py [--rows 8,32,64,128,256]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from graph_timing import graph_ms

from kernels import triton_ops

HIDDEN, Q, QKV, INTER, LAYERS, EPS = 1024, 2048, 4096, 3072, 28, 1e-6


@triton.jit
def _l2_prefetch(ptrs, nbytes):
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm_kernel(X, W, OUT, M, N, k_split, stride_xm, stride_wn, stride_om, stride_os,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.program_id(2) * k_split
    w_rows = W + cols.to(tl.int64) * stride_wn + lo
    if PREFETCH:
        nbytes = tl.zeros([BLOCK_N], tl.int32) + k_split * 2
        _l2_prefetch(w_rows, nbytes)
        if GATED:
            _l2_prefetch(w_rows + N * stride_wn, nbytes)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + lo + k[None, :], mask=rows[:, None] < M,
                    other=0.0)
        w = tl.load(w_rows[:, None] + k[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            w2 = tl.load(w_rows[:, None] + N * stride_wn + k[None, :])
            acc2 = tl.dot(x, tl.trans(w2), acc2)
    if GATED:
        acc = (acc / (1.0 + tl.exp(-acc))) * acc2
    tl.store(OUT + tl.program_id(2) * stride_os + rows[:, None] * stride_om + cols[None, :],
             acc.to(OUT.dtype.element_ty), mask=rows[:, None] < M)


@triton.jit
def _addnorm_kernel(X, R, W, OUT, N, eps, stride_xs, SPLITS: tl.constexpr, PDL: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    x = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        x += tl.load(X + s * stride_xs + row * N + cols).to(tl.float32)
    r = tl.load(R + row * N + cols).to(tl.float32)
    h = (x.to(R.dtype.element_ty).to(tl.float32) + r).to(R.dtype.element_ty)
    tl.store(R + row * N + cols, h)   # the residual is updated in place
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    y = (hf * rstd).to(h.dtype).to(tl.float32) * tl.load(W + cols).to(tl.float32)
    tl.store(OUT + row * N + cols, y.to(OUT.dtype.element_ty))


@triton.jit
def _silu_kernel(X, OUT, D, PDL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(X + row * 2 * D + cols).to(tl.float32)
    u = tl.load(X + row * 2 * D + D + cols).to(tl.float32)
    tl.store(OUT + row * D + cols, ((g / (1.0 + tl.exp(-g))) * u).to(OUT.dtype.element_ty))


def gemm(x, w, out, tile, *, gated=False, pdl=False, prefetch=False, splits=1, stride_xm=None):
    bm, bn, bk, warps, stages = tile
    m, n = x.shape[0], out.shape[-1]
    _gemm_kernel[(n // bn, triton.cdiv(m, bm), splits)](
        x, w, out, m, n, w.shape[1] // splits, stride_xm or x.stride(0), w.stride(0),
        out.stride(-2), out.stride(0) if splits > 1 else 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GATED=gated, PDL=pdl, PREFETCH=prefetch, num_warps=warps, num_stages=stages,
        launch_pdl=pdl)


def tiles_for(m):
    bms = sorted({min(128, max(16, triton.next_power_of_2(m))), min(64, max(16, triton.next_power_of_2(m)))})
    return [(bm, bn, bk, 4, st) for bm, bn, bk, st in
            itertools.product(bms, (32, 64, 128), (64, 128, 256), (3, 4)) if bm * bn <= 128 * 64 * 2]


def best_tile(m, n, k, weights, gated=False, splits_options=(1,)):
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    best = (float("inf"), None, 1)
    for tile, splits in itertools.product(tiles_for(m), splits_options):
        bn, bk = tile[1:3]
        if n % bn or (k // splits) % bk:
            continue
        out = torch.empty((splits, m, n) if splits > 1 else (m, n), device="cuda",
                          dtype=torch.float32 if splits > 1 else torch.bfloat16)
        try:
            t = 1e3 * graph_ms([lambda w=w, o=out, t=tile, s=splits:
                                gemm(x, w, o, t, gated=gated, splits=s) for w in weights])
        except Exception:  # noqa: BLE001, S112 - shared memory or registers exceeded
            continue
        best = min(best, (t, tile, splits), key=lambda b: b[0])
    return best


def check(m, wq, wo, wgu, wd, t_qkv, t_o, t_gu, t_gux, t_d) -> None:
    """Largest relative error of each chosen GEMM (every launch mode) against torch's."""
    worst = 0.0
    for w, t, gated in ((wq, t_qkv, False), (wo, t_o, False), (wgu, t_gu, False),
                        (wgu, t_gux, True), (wd, t_d, False)):
        x = torch.randn(m, w.shape[1], dtype=torch.bfloat16, device="cuda")
        ref = torch.nn.functional.linear(x, w).float()
        if gated:
            g, u = ref.chunk(2, dim=-1)
            ref = torch.nn.functional.silu(g) * u
        for pdl, pf in ((False, False), (True, True)):
            splits = t[2]
            out = torch.empty((splits, m, ref.shape[1]) if splits > 1 else ref.shape,
                              dtype=torch.float32 if splits > 1 else torch.bfloat16, device="cuda")
            gemm(x, w, out, t[1], gated=gated, pdl=pdl, prefetch=pf, splits=splits)
            got = (out.sum(0) if splits > 1 else out).float()
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    print(f"rows {m}: worst relative error of the Triton GEMMs {worst:.2e}"
          + ("  WRONG" if worst > 2e-2 else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32,64,128,256")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    w_qkv = [torch.randn(QKV, HIDDEN, dtype=bf, device=dev) * 0.03 for _ in range(LAYERS)]
    w_o = [torch.randn(HIDDEN, Q, dtype=bf, device=dev) * 0.03 for _ in range(LAYERS)]
    w_gu = [torch.randn(2 * INTER, HIDDEN, dtype=bf, device=dev) * 0.03 for _ in range(LAYERS)]
    w_d = [torch.randn(HIDDEN, INTER, dtype=bf, device=dev) * 0.03 for _ in range(LAYERS)]
    nw = torch.rand(HIDDEN, dtype=bf, device=dev) + 0.5
    print("rows  cublas  triton  pdl  pdl+pf  fused   (us per layer; tiles qkv/o/gate_up/down)")
    for m in [int(r) for r in args.rows.split(",")]:
        probe_rows(m, w_qkv, w_o, w_gu, w_d, nw)


def probe_rows(m, w_qkv, w_o, w_gu, w_d, nw) -> None:
    dev, bf = "cuda", torch.bfloat16
    t_qkv = best_tile(m, QKV, HIDDEN, w_qkv)
    t_o = best_tile(m, HIDDEN, Q, w_o, splits_options=(1, 2, 4, 8))
    t_gu = best_tile(m, 2 * INTER, HIDDEN, w_gu)
    t_gux = best_tile(m, INTER, HIDDEN, w_gu, gated=True)
    t_d = best_tile(m, HIDDEN, INTER, w_d, splits_options=(1, 2, 4, 8))
    h0 = torch.randn(m, HIDDEN, dtype=bf, device=dev)
    res = torch.randn(m, HIDDEN, dtype=bf, device=dev)
    hn = torch.empty(m, HIDDEN, dtype=bf, device=dev)
    qkv = torch.empty(m, QKV, dtype=bf, device=dev)
    gu = torch.empty(m, 2 * INTER, dtype=bf, device=dev)
    act = torch.empty(m, INTER, dtype=bf, device=dev)
    o_part = torch.empty(8, m, HIDDEN, dtype=torch.float32, device=dev)
    d_part = torch.empty(8, m, HIDDEN, dtype=torch.float32, device=dev)
    state = {}

    def cublas_layer(i):
        h, r = triton_ops.fused_add_rms_norm(state.get("h", h0), state.get("r", res), nw, EPS)
        q = torch.nn.functional.linear(h, w_qkv[i])
        o = torch.nn.functional.linear(q[:, :Q], w_o[i])
        h, r = triton_ops.fused_add_rms_norm(o, r, nw, EPS)
        a = triton_ops.silu_and_mul(torch.nn.functional.linear(h, w_gu[i]))
        state["h"], state["r"] = torch.nn.functional.linear(a, w_d[i]), r

    def triton_layer(i, pdl=False, pf=False, fused=False):
        o_splits = t_o[2] if fused else 1
        d_splits = t_d[2] if fused else 1
        d_in = state.get("d")
        _addnorm_kernel[(m,)](d_in if d_in is not None else h0, res, nw, hn, HIDDEN, EPS,
                              m * HIDDEN, SPLITS=state.get("ds", 1), PDL=pdl, BLOCK=HIDDEN,
                              num_warps=4, launch_pdl=pdl)
        gemm(hn, w_qkv[i], qkv, t_qkv[1], pdl=pdl, prefetch=pf)
        o_bf = torch.empty(m, HIDDEN, dtype=bf, device=dev) if o_splits == 1 else None
        gemm(qkv, w_o[i], o_bf if o_splits == 1 else o_part[:o_splits],
             t_o[1], pdl=pdl, prefetch=pf, splits=o_splits,
             stride_xm=QKV)
        _addnorm_kernel[(m,)](o_bf if o_splits == 1 else o_part, res, nw, hn, HIDDEN, EPS,
                              m * HIDDEN, SPLITS=o_splits, PDL=pdl, BLOCK=HIDDEN,
                              num_warps=4, launch_pdl=pdl)
        if fused:
            gemm(hn, w_gu[i], act, t_gux[1], gated=True, pdl=pdl, prefetch=pf)
        else:
            gemm(hn, w_gu[i], gu, t_gu[1], pdl=pdl, prefetch=pf)
            _silu_kernel[(m, INTER // 1024)](gu, act, INTER, PDL=pdl, BLOCK=1024,
                                             num_warps=4, launch_pdl=pdl)
        if d_splits > 1:
            gemm(act, w_d[i], d_part[:d_splits], t_d[1], pdl=pdl, prefetch=pf,
                 splits=d_splits)
            state["d"], state["ds"] = d_part, d_splits
        else:
            d = torch.empty(m, HIDDEN, dtype=bf, device=dev)
            gemm(act, w_d[i], d, t_d[1], pdl=pdl, prefetch=pf)
            state["d"], state["ds"] = d, 1

    check(m, w_qkv[0], w_o[0], w_gu[0], w_d[0], t_qkv, t_o, t_gu, t_gux, t_d)
    row = [m]
    for variant in ("cublas", "triton", "pdl", "pdl+pf", "fused"):
        state.clear()
        if variant == "cublas":
            calls = [lambda i=i: cublas_layer(i) for i in range(LAYERS)]
        else:
            kw = {"pdl": variant != "triton", "pf": variant in ("pdl+pf", "fused"),
                  "fused": variant == "fused"}
            calls = [lambda i=i, kw=kw: triton_layer(i, **kw) for i in range(LAYERS)]
        try:
            row.append(1e3 * graph_ms(calls))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(variant, "failed:", str(exc).splitlines()[0][:200])
            row.append(float("nan"))
    # correctness of the triton chain against cublas' (one layer, no PDL)
    print(f"{m:4d} " + " ".join(f"{t:7.2f}" for t in row[1:]) +
          f"   {t_qkv[1][:3]} {t_o[1][:3]}x{t_o[2]} {t_gu[1][:3]} {t_gux[1][:3]} "
          f"{t_d[1][:3]}x{t_d[2]}  isolated us: qkv {t_qkv[0]:.2f} o {t_o[0]:.2f} "
          f"gu {t_gu[0]:.2f} gu+silu {t_gux[0]:.2f} d {t_d[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
