"""A data plane's start, in a fresh process per repeat: importing torch, importing the worker
(``dataplane.worker``: kernels, Triton, the sampler) and constructing it (the model built on
the meta device and loaded, the KV cache allocated, the warm-up, CUDA graphs on a GPU), with the
modules that construction imported beside it (``torch._dynamo`` is the tell of an operation
run through torch's Python references: ~2 s of a CPU start before 2026-12-03).

``--tree`` runs another checkout's worker (e.g. an older commit's ``git archive``) with the
same options, for a before/after in one run.

    python -m bench.worker_start [--model DIR] [--device cpu|cuda] [--repeats 3]
        [--num-kv-blocks 1024] [--enforce-eager] [--tree DIR]

Prints one JSON line per repeat (seconds) and one with the medians."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Run in the child, with the tree's own modules first on the path.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from common.worker_options import WorkerOptions
from dataplane.worker import Worker
t2 = time.perf_counter()
opts = json.loads(sys.argv[1])
worker = Worker(WorkerOptions(**opts))
if torch.cuda.is_available():
    torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"import_torch_s": round(t1 - t0, 3), "import_worker_s": round(t2 - t1, 3),
                  "construct_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3),
                  "dynamo_imported": "torch._dynamo" in sys.modules,
                  "fx_symbolic_shapes_imported": "torch.fx.experimental.symbolic_shapes" in sys.modules}))
"""


def one_start(tree: pathlib.Path, opts: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "protos"),
                                                       os.environ.get("PYTHONPATH", "")]),
               HEADRACE_LOG_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(opts)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"worker_start: the worker did not start:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-kv-blocks", type=int, default=1024,
                    help="a fixed KV pool (the memory-sized default spends its time zeroing memory)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose worker starts (default: this one)")
    args = ap.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    model = args.model or str(tree / "dataplane" / "default_model" / "tiny")
    opts = {"model": model, "device": args.device, "num_kv_blocks": args.num_kv_blocks}
    if args.enforce_eager:
        opts["enforce_eager"] = True
    rows = []
    for i in range(args.repeats):
        row = dict(one_start(tree, opts), repeat=i, tree=str(tree), device=args.device,
                   model=os.path.basename(model.rstrip("/")))
        rows.append(row)
        print(json.dumps(row), flush=True)
    medians = {k: round(statistics.median(r[k] for r in rows), 3)
               for k in ("import_torch_s", "import_worker_s", "construct_s", "total_s")}
    print(json.dumps(dict(medians, summary="median", repeats=len(rows), tree=str(tree),
                          device=args.device)), flush=True)


if __name__ == "__main__":
    main()
