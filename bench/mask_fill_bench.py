"""The engine's host cost of a constrained step, without the planes: per step of a batch of
sequences under ``structured_bench``'s JSON schema, the time to advance every matcher by its token
(``accept``; ``accept_par``: llguidance's parallel consume, on alternate steps), to fill the batch's
bitmasks (``Backend.fill_rows``, llguidance's parallel executor) and to pack them for the wire
(``shared_masks.pack``); and the worker's cost to turn the message into its sampler's arrays
(``unpack``: ``headrace.dataplane.bitmasks.arrays``). Each row's tokens are drawn at random from its
allowed ones (seeded), so the rows wander through the schema's states as a random-weight model's do.
On the serving host these sit on every constrained token's critical path at batch 64
(docs/structured_outputs.md, *Performance*). With ``--lanes on,off`` llguidance's rows are measured
both with one independent template per executor thread (the engine's way,
``headrace.controlplane.structured.guidance``) and all copied from one template.

    python -m bench.mask_fill_bench --model DIR [--batches 1,64] [--steps 200] [--backends guidance]
    [--lanes on,off]

``--model`` needs a tokenizer (``bench.random_checkpoint --tokenizer bytelevel``); prints one
JSON line per (backend, batch): medians and p90s in ms, distinct masks per step and wire bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time
import types

import numpy as np

try:
    import llguidance.numpy
except ImportError:   # (xgrammar alone)
    llguidance = None

from bench.structured_bench import LONG
from headrace.controlplane.structured import backends, shared_masks
from headrace.controlplane.structured.spec import Constraint
from headrace.dataplane import bitmasks
from headrace.worker.v1 import worker_pb2 as wpb


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def _compiled(backend, lanes: bool):
    """The bench schema compiled, with all its lanes built (``lanes``) or only the first."""
    if not lanes and hasattr(backend, "build_lanes"):
        backend.build_lanes = types.MethodType(lambda self, compiled: None, backend)
    compiled = backend.compile(Constraint(kind="json", text=json.dumps(LONG)))
    compiled.matcher(), compiled.matcher()   # a second sequence: the lanes are built
    deadline = time.monotonic() + 60
    while lanes and len(getattr(compiled, "lanes", ())) < getattr(backend, "num_lanes", 0):
        if time.monotonic() > deadline:
            raise SystemExit("the lanes were not built within 60 s")
        time.sleep(0.01)
    return compiled


def run(backend, batch: int, steps: int, seed: int, lanes: bool = True) -> dict:
    compiled = _compiled(backend, lanes)
    matchers = [compiled.matcher() for _ in range(batch)]
    rows = np.empty((batch, backends.bitmask_words(backend.vocab_size)), dtype="<i4")
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"accept": [], "fill": [], "pack": [], "accept_par": [], "unpack": []}
    step_seqs = np.arange(batch, dtype=np.int64)
    distinct, wire = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        backend.fill_rows(matchers, rows, list(range(batch)))
        t1 = time.perf_counter()
        out = wpb.TokenBitmask(seq_ids=range(batch))
        shared_masks.pack(rows, out)
        t2 = time.perf_counter()
        bitmasks.arrays(out, step_seqs, None, backend.vocab_size)
        times["unpack"].append(time.perf_counter() - t2)
        distinct.append(len(set(out.mask_of)) if out.mask_of else batch)
        wire.append(out.ByteSize())
        tokens = []
        for row in rows:
            allowed = _allowed(row, backend.vocab_size)
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        par = backend.name == "guidance" and len(matchers) > 1 and len(times["fill"]) % 2
        t3 = time.perf_counter()
        if par:   # odd steps: llguidance's parallel consume (its executor's threads)
            ok = llguidance.numpy.consume_token_par(
                backend._executor, [(m._m, t) for m, t in zip(matchers, tokens)])
        else:
            ok = [m.accept(t) for m, t in zip(matchers, tokens)]
        t4 = time.perf_counter()
        if not all(ok):
            raise SystemExit("a matcher rejected a token its own mask allowed")
        if any(m.finished for m in matchers):   # (the schema runs longer than --steps)
            matchers = [compiled.matcher() if m.finished else m for m in matchers]
        times["fill"].append(t1 - t0)
        times["pack"].append(t2 - t1)
        times["accept_par" if par else "accept"].append(t4 - t3)
    out = {"backend": backend.name, "batch": batch, "steps": steps,
           "lanes": len(getattr(compiled, "lanes", [None])) if lanes else 1}
    for name, values in times.items():
        if not values:
            continue
        values.sort()
        out[f"{name}_ms_p50"] = round(statistics.median(values) * 1e3, 4)
        out[f"{name}_ms_p90"] = round(values[int(0.9 * len(values))] * 1e3, 4)
    out["total_ms_p50"] = round(sum(out[f"{k}_ms_p50"] for k in ("accept", "fill", "pack")), 4)
    out["distinct_masks_p50"] = statistics.median(distinct)
    out["wire_kb_p50"] = round(statistics.median(wire) / 1e3, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory with tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=None, help="the logits' width (default: config.json's)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backends", default="guidance", help="comma-separated: guidance, xgrammar")
    ap.add_argument("--lanes", default="on", help="comma-separated: on, off (llguidance's lanes)")
    ap.add_argument("--threads", type=int, default=None,
                    help="llguidance's executor threads (default: its own, 80%% of the cores)")
    ap.add_argument("--lanes-per-thread", default="1", help="comma-separated counts (llguidance)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = args.vocab_size
    if vocab is None:
        with open(f"{args.model}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
    rows = []
    for name in args.backends.split(","):
        cases = [(lanes, int(per)) for lanes in args.lanes.split(",")
                 for per in (args.lanes_per_thread.split(",") if lanes == "on" else [1])]
        for lanes, per in cases if name == "guidance" else [("on", 1)]:
            backend = backends.load(backends.resolve(name), args.model, vocab, [])
            if name == "guidance":
                backend = type(backend)(pathlib.Path(args.model) / "tokenizer.json", vocab, [], args.threads, per)
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(run(backend, batch, args.steps, args.seed, lanes == "on"))
                print(json.dumps(rows[-1]), flush=True)
    print(f"{'backend':<9} {'lanes':>5} {'batch':>5} {'accept':>8} {'par':>8} {'fill':>8} {'pack':>8} {'total':>8} {'unpack':>8}"
          "  ms p50 (distinct masks, wire KB)")
    for r in rows:
        print(f"{r['backend']:<9} {r['lanes']:>5} {r['batch']:>5} {r['accept_ms_p50']:>8.3f} "
              f"{r.get('accept_par_ms_p50', float('nan')):>8.3f} {r['fill_ms_p50']:>8.3f} "
              f"{r['pack_ms_p50']:>8.3f} {r['total_ms_p50']:>8.3f} {r['unpack_ms_p50']:>8.3f}  ({r['distinct_masks_p50']}, {r['wire_kb_p50']})")


if __name__ == "__main__":
    main()
