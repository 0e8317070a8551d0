"""The worker's host time to sample a step on its late bitmasks: eagerly (the bitmasks' arrays
staged through the runner's pinned buffers and uploaded, ``sampler.sample``'s launches, the scatter
into ``last_token`` and the ids' download) against a replay of
``headrace.dataplane.late_sampling``'s graph. Both take the same ``bitmasks.arrays`` output, per
batch, with masks in the shared form as the engine sends a batch of one schema (``--masks``
distinct, one sparse, listed as token ids).

This is the part of a constrained token's critical path that the graph replaces
(``bench.late_mask_hops``' "upload, mask, race" hop); each call is synchronised before the
next, so the host time is the launches' alone.

    python -m bench.late_sample_host [--batches 1,64] [--vocab 151936] [--iters 300] [--masks 3]

Prints one JSON line per batch: host µs per call (median, p90) of each path and of
``bitmasks.arrays``."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from headrace.controlplane.structured import shared_masks
from headrace.dataplane import bitmasks, sampler, staging
from headrace.dataplane.late_sampling import LateSampler
from headrace.dataplane.sampler import SamplingBatch, SamplingRow
from headrace.worker.v1 import worker_pb2 as wpb


def _message(batch: int, words: int, distinct: int, rng) -> wpb.TokenBitmask:
    """A batch's bitmasks as the engine packs them: ``distinct`` masks, the last sparse."""
    masks = [rng.integers(-2**31, 2**31, size=words, dtype=np.int64).astype("<i4")
             for _ in range(max(1, distinct - 1))]
    sparse = np.zeros(words, "<i4")
    sparse[rng.integers(0, words, size=20)] = 1
    masks.append(sparse)
    rows = np.stack([masks[i % len(masks)] for i in range(batch)])
    out = wpb.TokenBitmask(seq_ids=range(batch))
    shared_masks.pack(rows, out)
    return out


def _median_p90(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return round(statistics.median(values) * 1e6, 1), round(values[int(0.9 * len(values))] * 1e6, 1)


def run(batch: int, vocab: int, iters: int, distinct: int, device: torch.device) -> dict:
    rng = np.random.default_rng(batch)
    words = (vocab + 31) // 32
    message = _message(batch, words, distinct, rng)
    seq_ids = np.arange(batch, dtype=np.int64)
    rows = SamplingBatch.of_rows([SamplingRow(0.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None, 0, 0, [], [1], [])] * batch)
    host = {"s_" + k: v for k, v in sampler.device_arrays(rows, rng).items()}
    host["last_rows"] = np.arange(batch, dtype=np.int64)
    logits = torch.randn(batch, vocab, device=device).to(torch.bfloat16)
    last_token = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    late = LateSampler(logits, last_token)
    stager = staging.Stager(device)
    dev = stager.upload(host)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"arrays": [], "eager": [], "graph": []}
    for i in range(iters + 10):
        t0 = time.perf_counter()
        masks = bitmasks.arrays(message, seq_ids, None, vocab)
        t1 = time.perf_counter()
        d = dev | stager.upload(masks)
        out = sampler.sample(logits, rows, {k[2:]: v for k, v in d.items() if k.startswith("s_")})
        last_token[d["last_rows"]] = out.token_ids
        out.start_download()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        late.sample(logits, host, masks)
        t4 = time.perf_counter()
        sync()
        if i >= 10:   # (the first: the graph's capture, and kernels' compiles)
            times["arrays"].append(t1 - t0)
            times["eager"].append(t2 - t1)
            times["graph"].append(t4 - t3)
    result = {"batch": batch, "vocab": vocab, "distinct_masks": len(message.allowed_counts) or batch,
              "device": str(device), "graph_replays": late.num_replays}
    for name, values in times.items():
        result[f"{name}_us_p50"], result[f"{name}_us_p90"] = _median_p90(values)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--masks", type=int, default=3, help="distinct masks in a batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for batch in map(int, args.batches.split(",")):
        print(json.dumps(run(batch, args.vocab, args.iters, args.masks, torch.device(args.device))), flush=True)


if __name__ == "__main__":
    main()
