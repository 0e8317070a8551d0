"""A data plane's start, in a fresh process per repeat: importing torch, importing the worker
(``headrace.dataplane.worker``: kernels, Triton, the sampler) and constructing it (the model built
on the meta device and loaded, the KV cache allocated, the warm-up, CUDA graphs on a GPU), with the
modules that construction imported beside it (``torch._dynamo`` is the tell of an operation run
through torch's Python references: ~2 s of a CPU start before 2026-12-03).

``--serve`` times the whole ``headrace serve`` instead (one front end): from its start to
SERVING on gRPC health, and from SIGTERM to the exit of its process tree (the data plane's
exit included). ``--tree`` runs another checkout's worker or serve (e.g. an older commit's
``git archive``) with the same options, for a before/after in one run.

    python -m bench.worker_start [--model DIR] [--device cpu|cuda] [--repeats 3]
        [--num-kv-blocks 1024] [--enforce-eager] [--serve] [--tree DIR]

Prints one JSON line per repeat (seconds) and one with the medians."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Run in the child, with the tree's own modules first on the path.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from headrace.common.worker_options import WorkerOptions
from headrace.dataplane.worker import Worker
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
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(opts)], cwd=tree, env=_env(tree),
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"worker_start: the worker did not start:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(tree: pathlib.Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "protos"),
                                                        os.environ.get("PYTHONPATH", "")]),
                HEADRACE_LOG_LEVEL="WARNING")


def one_serve(tree: pathlib.Path, opts: dict) -> dict:
    """``headrace serve`` of ``tree``: seconds to SERVING, and from SIGTERM to its exit."""
    import grpc

    from headrace.client import connection

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-P", "-m", "headrace.cli", "serve", "--model", opts["model"], "--device", opts["device"],
            "--num-kv-blocks", str(opts["num_kv_blocks"]), "--host", "127.0.0.1", "--port", str(port),
            "--http-port", "0", "--metrics-port", "0", "--dataplane-metrics-port", "0",
            "--api-server-count", "1", *(["--enforce-eager"] if opts.get("enforce_eager") else [])]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as channel:   # probed every 20 ms (the client: 250)
            while connection.probe(channel, connection.ConnectionOptions(address), 1.0)[0] != connection.SERVING:
                if proc.poll() is not None or time.perf_counter() - start > 600:
                    raise SystemExit(f"worker_start: serve ended or never served (exit {proc.returncode})")
                time.sleep(0.02)
        serving = time.perf_counter() - start
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        return {"serving_s": round(serving, 3), "exit_s": round(time.perf_counter() - stop, 3)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-kv-blocks", type=int, default=1024,
                    help="a fixed KV pool (the memory-sized default spends its time zeroing memory)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    ap.add_argument("--serve", action="store_true",
                    help="time headrace serve (to SERVING, SIGTERM to exit) instead of the worker alone")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose worker starts (default: this one)")
    args = ap.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    model = args.model or str(tree / "dataplane" / "default_model" / "tiny")
    opts = {"model": model, "device": args.device, "num_kv_blocks": args.num_kv_blocks}
    if args.enforce_eager:
        opts["enforce_eager"] = True
    rows = []
    for i in range(args.repeats):
        row = dict((one_serve if args.serve else one_start)(tree, opts), repeat=i, tree=str(tree), device=args.device,
                   model=os.path.basename(model.rstrip("/")))
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ("serving_s", "exit_s") if args.serve else ("import_torch_s", "import_worker_s", "construct_s", "total_s")
    medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}
    print(json.dumps(dict(medians, summary="median", repeats=len(rows), tree=str(tree),
                          device=args.device)), flush=True)


if __name__ == "__main__":
    main()
