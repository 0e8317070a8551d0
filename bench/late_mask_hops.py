"""Where a constrained token's time goes, hop by hop, from the stage times both planes stamp
(``common/stage_times.py``; ``HEADRACE_STAGE_TIMES=DIR`` set for the server's processes, e.g.
around ``bench.structured_bench``). For each step S sampled on late bitmasks, the chain that
makes its token: the worker answers S-1 (whose tokens S's masks need), the engine receives and
folds it, fills and sends S's bitmasks, the worker reads them, samples, waits for the device and
answers S; beside it, when S's forward pass was launched.

    python -m bench.late_mask_hops DIR [--skip 50] [--last N]

Prints the medians (ms) of each hop over the late-masked steps, one table row per hop."""

from __future__ import annotations

import argparse
import statistics

from headrace.common import stage_times

# (label, from stage of step S-1 or S, to stage): each hop of the chain, in order
HOPS = [
    ("worker yields S-1's answer -> gRPC has written it", ("prev", "w_answer"), ("prev", "w_written")),
    ("worker yields S-1's answer -> the engine has it", ("prev", "w_answer"), ("prev", "result")),
    ("the engine folds S-1's tokens (matchers consume)", ("prev", "result"), ("prev", "folded")),
    ("folded -> S's bitmasks begin", ("prev", "folded"), ("cur", "late_fill")),
    ("fill + pack + send S's bitmasks", ("cur", "late_fill"), ("cur", "late_sent")),
    ("sent -> the worker reads them", ("cur", "late_sent"), ("cur", "w_late")),
    ("worker: sample S (mask upload, sampler launch)", ("cur", "w_late"), ("cur", "w_sampled")),
    ("  of which: read -> the pipeline has it", ("cur", "w_late"), ("cur", "w_sample_in")),
    ("  of which: the bitmasks' arrays", ("cur", "w_sample_in"), ("cur", "w_masks")),
    ("  of which: upload, mask, race (launches)", ("cur", "w_masks"), ("cur", "w_sampled")),
    ("sampled -> waits for S's tokens", ("cur", "w_sampled"), ("cur", "w_finish")),
    ("waits for the device, builds the answer", ("cur", "w_finish"), ("cur", "w_answer")),
    ("a token: S-1's answer -> S's answer", ("prev", "w_answer"), ("cur", "w_answer")),
    ("(S launched, after S-1's answer written)", ("prev", "w_written"), ("cur", "w_launch")),
    ("(S launched, before its bitmasks read)", ("cur", "w_launch"), ("cur", "w_late")),
]


def hops(rows, skip: int = 50, last: int = 0) -> list[tuple[str, float | None, int]]:
    """(label, median ms, count) per hop over the late-masked steps (the first ``skip`` dropped:
    warm-up; with ``last``, only the last ``last`` of them: the bench's final run)."""
    at: dict[int, dict[str, float]] = {}
    for t, key, stage, _ in rows:
        if key.startswith("step:"):
            at.setdefault(int(key[5:]), {}).setdefault(stage, t)
    late = sorted(s for s, st in at.items() if "w_late" in st and s - 1 in at)[skip:]
    late = late[-last:] if last else late
    out = []
    for label, (a_of, a), (b_of, b) in HOPS:
        values = []
        for s in late:
            steps = {"prev": at[s - 1], "cur": at[s]}
            if a in steps[a_of] and b in steps[b_of]:
                values.append((steps[b_of][b] - steps[a_of][a]) * 1e3)
        out.append((label, round(statistics.median(values), 3) if values else None, len(values)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--skip", type=int, default=50, help="late-masked steps dropped first (warm-up)")
    ap.add_argument("--last", type=int, default=0, help="only the last N late-masked steps")
    args = ap.parse_args()
    print("| hop | median ms | steps |\n| --- | --- | --- |")
    for label, value, n in hops(stage_times.read(args.directory), args.skip, args.last):
        print(f"| {label} | {value if value is not None else '-'} | {n} |")


if __name__ == "__main__":
    main()
