"""Summarises a profile that ``headrace admin profile`` wrote: per data-plane trace, the top
kernels by total device time (on a GPU; the top host ops by self time on a CPU, which has no
kernels), how many step ranges it holds, and the engine core's busiest functions.

    python -m bench.profile_summary DIR [--top 10] [--json]

Exit status 1 when DIR holds no trace, a trace does not parse, or (``--require-kernels``) a
trace names no CUDA kernel."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pstats
import sys


def trace_summary(path: str, top: int) -> dict:
    """Kernels (``cat: kernel`` events) by total duration, else host ops by self time."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    steps = 0
    for e in events:
        name, cat, dur = e.get("name", ""), e.get("cat", ""), float(e.get("dur", 0) or 0)
        if cat == "kernel":
            kernels[name] += dur
            calls[name] += 1
        elif cat == "cpu_op":
            ops[name] += dur
        elif name.startswith("headrace.step "):
            steps += 1
    table = kernels if kernels else ops
    return {"trace": path, "steps": steps, "kernels": len(kernels), "kernel_us": round(sum(kernels.values()), 1),
            "by": "kernel device time" if kernels else "host op time (no CUDA kernels)",
            "top": [{"name": n, "us": round(us, 1), "calls": calls[n] or None}
                    for n, us in table.most_common(top)]}


# the event loop's own frames: they wrap everything the core does, and its idle waits
_LOOP_FILES = {"base_events.py", "selectors.py", "events.py"}


def _loop_frame(file: str, name: str) -> bool:
    return os.path.basename(file) in _LOOP_FILES or "epoll" in name or "Context' objects" in name


def core_summary(path: str, top: int) -> list[dict]:
    """The engine core's functions by cumulative time, the event loop's frames left out."""
    stats = pstats.Stats(path)
    rows = sorted(((key, value) for key, value in stats.stats.items() if not _loop_frame(key[0], key[2])),
                  key=lambda kv: kv[1][3], reverse=True)   # cumulative time
    return [{"function": f"{os.path.basename(file)}:{line}({name})", "cumulative_s": round(ct, 4),
             "calls": nc} for (file, line, name), (_, nc, _, ct, _) in rows[:top]]


def summarise(directory: str, top: int) -> dict:
    traces = sorted(glob.glob(os.path.join(directory, "*.pt.trace.json")))
    cores = sorted(glob.glob(os.path.join(directory, "core.*.pstats")))
    return {"traces": [trace_summary(t, top) for t in traces],
            "core": core_summary(cores[-1], top) if cores else []}


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--require-kernels", action="store_true", help="fail unless every trace names CUDA kernels")
    args = ap.parse_args(argv)
    try:
        out = summarise(args.dir, args.top)
    except (OSError, ValueError, KeyError) as exc:
        print(f"profile_summary: {exc}", file=sys.stderr)
        return 1
    if not out["traces"]:
        print(f"profile_summary: no *.pt.trace.json in {args.dir}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        for t in out["traces"]:
            print(f"{t['trace']}: {t['steps']} steps, {t['kernels']} distinct kernels, "
                  f"{t['kernel_us'] / 1e3:.2f} ms of kernels; top by {t['by']}:")
            for row in t["top"]:
                print(f"  {row['us'] / 1e3:9.3f} ms  {row['calls'] or '':>6}  {_short(row['name'])}")
        if out["core"]:
            print("engine core, top by cumulative time:")
            for row in out["core"]:
                print(f"  {row['cumulative_s'] * 1e3:9.2f} ms  {row['calls']:>7}  {row['function']}")
    if args.require_kernels and not all(t["kernels"] for t in out["traces"]):
        print("profile_summary: a trace names no CUDA kernel", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
