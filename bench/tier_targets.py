"""Issue 33's targets from one device call's results (``bash bench/gpu_run.sh tier``): reads the
JSON lines ``bench.w5_bench`` and ``bench.tier_bench`` wrote (``$OUT/results.jsonl``) and the
GPU tests' summary line, and prints one table: each target, the figures it is judged on
(same-call baselines) and whether it is met.

    python -m bench.tier_targets $OUT/results.jsonl --tests $OUT/tier-tests.txt
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics


def _rows(path: str) -> list[dict]:
    rows = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _w5(rows: list[dict], model: str, mode: str) -> dict | None:
    """The median TTFT p50 and throughput of a model's W5 runs of ``mode`` (None: none ran)."""
    runs = [r for r in rows if r.get("workload") == "w5" and r.get("model") == model
            and r.get("offloading") == mode]
    if not runs:
        return None
    return {"ttft": statistics.median(r["ttft_ms_p50"] for r in runs),
            "tput": statistics.median(r["output_tok_per_s"] for r in runs), "runs": runs}


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def targets(rows: list[dict], tests: str | None) -> list[tuple[str, str, str]]:
    out = []
    for model, name in (("llama8b", "Llama-3.1-8B"), ("qwen3", "Qwen3-0.6B")):
        off, auto = _w5(rows, model, "off"), _w5(rows, model, "auto")
        if off is None or auto is None:
            out.append((f"W5 {name}", "not run", "-"))
            continue
        ttft, tput = off["ttft"] / auto["ttft"], auto["tput"] / off["tput"]
        figures = (f"TTFT p50 off {off['ttft']:.1f} / auto {auto['ttft']:.1f} ms ({ttft:.2f}x better), "
                   f"tok/s off {off['tput']:.0f} / auto {auto['tput']:.0f} ({tput:.2f}x)")
        hits = auto["runs"][-1]
        figures += (f"; auto host hit rate {hits.get('hit_rate_host')}, load {hits.get('load_us_per_token')} / "
                    f"recompute {hits.get('recompute_us_per_token')} us/token")
        if model == "llama8b":
            out.append((f"W5 {name}: TTFT p50 >= 2x, throughput >= 1.3x", figures, _met(ttft >= 2.0 and tput >= 1.3)))
        else:
            out.append((f"W5 {name}: auto within 5% of off", figures, _met(ttft >= 0.95 and tput >= 0.95)))
        same = [r["tokens_vs_first"] for r in off["runs"][1:] + auto["runs"] if "tokens_vs_first" in r]
        if same:
            out.append((f"W5 {name}: tokens against the first mode",
                        "; ".join(f"{s['same_conversations']}/{s['conversations']} conversations equal to {s['vs']}"
                                  + (f", first difference at turn >= {s['first_divergence_turn_min']}"
                                     if "first_divergence_turn_min" in s else "") for s in same), "-"))
    idle = next((r for r in rows if r.get("workload") == "w1-tier-idle-summary"), None)
    if idle is None:
        out.append(("W1 with an idle tier within 2%", "not run", "-"))
    else:
        out.append(("W1 with an idle tier within 2%",
                    f"none {idle['none_tok_per_s']:.0f} / idle tier {idle['idle_tier_tok_per_s']:.0f} tok/s "
                    f"({idle['idle_over_none']:.3f}x, in one process)", _met(idle["idle_over_none"] >= 0.98)))
    swap = next((r for r in rows if r.get("workload") == "w1-preemption-summary"), None)
    if swap is not None:
        out.append(("--preemption-mode swap vs recompute (reported)",
                    ", ".join(f"{m} {v:.0f} tok/s ({swap['over_first'][m]:.2f}x, {swap['preemptions'][m]} preemptions)"
                              for m, v in swap["tok_per_s"].items()), "-"))
    if tests:
        out.append(("GPU exactness and copy tests pass", *_tests_verdict(pathlib.Path(tests))))
    return out


def _tests_verdict(path: pathlib.Path) -> tuple[str, str]:
    """(pytest's summary and gpu_run.sh's ``pytest exit N`` line, met or not): the exit status
    decides where it was written (pytest's own summary is hidden under -q -q)."""
    lines = path.read_text().strip().splitlines() if path.exists() else []
    status = next((ln for ln in reversed(lines) if ln.startswith("pytest exit ")), None)
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), None)
    line = "; ".join(x for x in (summary, status) if x) or "no output"
    if status is not None:
        return line, _met(status == "pytest exit 0")
    return line, _met(summary is not None and "failed" not in summary and "error" not in summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="the JSON lines of the call (results.jsonl)")
    ap.add_argument("--tests", default=None, help="the GPU tests' output (its last line is pytest's summary)")
    args = ap.parse_args()
    print("| issue 33 target | figures (same call) | |")
    print("| --- | --- | --- |")
    for target, figures, met in targets(_rows(args.results), args.tests):
        print(f"| {target} | {figures} | {met} |")


if __name__ == "__main__":
    main()
