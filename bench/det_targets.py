"""Issue 54's targets (``--deterministic``) from one ``bench/gpu_run.sh`` call's JSON lines and
its GPU tests' summary: each target, its same-call figures, and whether it is met.

    python -m bench.det_targets /tmp/headrace-out/results.jsonl --tests /tmp/headrace-out/det-tests.txt

Reads the lines of the ``det*`` sections: ``serving_bench`` runs labelled ``w1-base`` /
``w1-det``, ``w2-*``, ``w3-*``; ``w4_bench`` sweeps with ``"deterministic"`` false / true and
its ``w4-identity`` line; ``w5_bench`` rows run with ``--deterministic``; the in-process W2
runs of ``detspec`` (speculation off / on). A target whose runs are missing says so.
"""

from __future__ import annotations

import argparse
import json

from bench.gpu_table import _lines


def _by_label(lines: list[dict], label: str) -> dict | None:
    return next((d for d in reversed(lines) if d.get("label") == label), None)


def _ratio(rows: list, name: str, key: str, target: str, better_high: bool, limit: float,
           base: dict | None, det: dict | None) -> None:
    if not base or not det or not base.get(key) or det.get(key) is None:
        rows.append((name, target, "runs missing", "-"))
        return
    r = det[key] / base[key]
    met = r >= limit if better_high else r <= limit
    rows.append((name, target, f"{det[key]} / {base[key]} = {r:.3f}x", "met" if met else "NOT met"))


def targets(lines: list[dict], tests: str | None) -> list[tuple]:
    rows: list[tuple] = []
    if tests is not None:
        try:
            text = open(tests, encoding="utf-8").read()
        except OSError:
            text = ""
        summary = next((ln for ln in reversed(text.splitlines()) if " passed" in ln or " failed" in ln), "-")
        rows.append(("GPU tests (kernels and serving)", "all pass", summary.strip(),
                     "met" if "pytest exit 0" in text else "NOT met"))
    _ratio(rows, "W1 tok/s, det / default", "output_tok_per_s", ">= 0.85x", True, 0.85,
           _by_label(lines, "w1-base"), _by_label(lines, "w1-det"))
    _ratio(rows, "W3 tok/s, det / default", "output_tok_per_s", ">= 0.85x", True, 0.85,
           _by_label(lines, "w3-base"), _by_label(lines, "w3-det"))
    _ratio(rows, "W2 ITL p50, det / default", "itl_ms_p50", "<= 1.10x", False, 1.10,
           _by_label(lines, "w2-base"), _by_label(lines, "w2-det"))
    _ratio(rows, "W2 TTFT p50, det / default (no target)", "ttft_ms_p50", "-", False, float("inf"),
           _by_label(lines, "w2-base"), _by_label(lines, "w2-det"))
    w4 = {bool(d.get("deterministic")): d for d in lines if d.get("workload") == "w4"}
    if len(w4) == 2 and w4[False].get("max_rate_at_slo") and w4[True].get("max_rate_at_slo") is not None:
        _ratio(rows, "W4 highest rate at the SLO, det / default", "max_rate_at_slo", ">= 0.8x", True,
               0.8, w4[False], w4[True])
    else:
        rows.append(("W4 highest rate at the SLO, det / default", ">= 0.8x", "runs missing (or no rate "
                     "met the SLO)", "-"))
    ident = next((d for d in reversed(lines) if d.get("workload") == "w4-identity"), None)
    if ident:
        rates = ", ".join(f"{r['rate']:g}: {r['vs_first_rate']['equal']}/{r['vs_first_rate']['compared']}"
                          for r in ident["rates"])
        alone = ident.get("alone") or {}
        ok = ident["identical_across_rates"] and alone.get("identical", False) and ident["deterministic"]
        rows.append((f"W4 {ident['requests']} requests bit-identical ({ident['digest']}) across "
                     "rates and alone",
                     "all equal", f"rates {rates}; alone {alone.get('equal')}/{alone.get('compared')}",
                     "met" if ok else "NOT met"))
    else:
        rows.append(("W4 requests bit-identical across rates and alone", "all equal", "run missing", "-"))
    w5 = [d for d in lines if d.get("workload") == "w5" and d.get("deterministic")]
    if w5:
        digests = {d["histories_digest"] for d in w5}
        same = [f"{d['offloading']}: {d['tokens_vs_first'].get('same_with_logprobs')}/"
                f"{d['tokens_vs_first']['conversations']}" for d in w5 if d.get("tokens_vs_first")]
        rows.append(("W5 digests across host tier " + "/".join(d["offloading"] for d in w5), "equal",
                     f"{len(digests)} distinct; vs first: {', '.join(same)}",
                     "met" if len(digests) == 1 and len(w5) > 1 else "NOT met"))
    else:
        rows.append(("W5 digests across host-tier off / auto / always", "equal", "runs missing", "-"))
    spec = {d["workload"]: d for d in lines if d.get("deterministic") and "output_digest" in d
            and str(d.get("workload", "")).startswith("w2-grounded")}
    off, on = spec.get("w2-grounded-in-process"), spec.get("w2-grounded-spec-in-process")
    if off and on:
        rows.append(("W2 grounded, n-gram speculation on / off, det", "same outputs",
                     f"{on['output_digest']} / {off['output_digest']}; acceptance "
                     f"{on.get('spec_acceptance')}; ITL p50 {on['itl_ms_p50']} / {off['itl_ms_p50']} ms",
                     "met" if on["output_digest"] == off["output_digest"] else "NOT met"))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--tests", default=None, help="the GPU tests' output (det-tests.txt)")
    args = ap.parse_args(argv)
    print("| target | wanted | same-call figures | |")
    print("| --- | --- | --- | --- |")
    for name, want, got, verdict in targets(_lines(args.results), args.tests):
        print(f"| {name} | {want} | {got} | {verdict} |")


if __name__ == "__main__":
    main()
