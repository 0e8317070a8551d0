"""The short table a ``bench/gpu_run.sh`` call prints last: its JSON lines (``results.jsonl``)
reduced to the figures issue 31 targets, each beside its same-run baseline where it has one.

    python -m bench.gpu_table /tmp/headrace-out/results.jsonl

Rows: W2 through gRPC per ``--label`` (TTFT p50, ITL p50 / p99; the default run against the
pipeline-depth variants), the first-token decomposition of every line that has one (the stages
of ``bench.first_token``, ms), ``core_overhead`` (TTFT p50 and min), W1 streamed against W1
offline in the same call (tok/s, the ratio, whether a client process was the limit), and W4
per front-end count and rate (served req/s, TTFT and ITL p50 / p99, the SLO, the busiest client
process, the device's idle share, execute / device ms per step by kind), with the highest rate
that met the SLO and served N=4 / N=1 at a rate both ran."""

from __future__ import annotations

import argparse
import json

from bench.first_token import STAGES


def _lines(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def _kinds(row: dict) -> str:
    return " ".join(f"{k}:{v['execute_ms']:.1f}/{v['device_ms'] or 0:.1f}"
                    for k, v in (row.get("steps_by_kind") or {}).items())


def table(lines: list[dict]) -> str:
    out = ["| run | figure |", "| --- | --- |"]
    for d in lines:
        w, label = d.get("workload"), d.get("label") or ""
        if w == "w2":
            out.append(f"| W2 {label} | TTFT p50 {d['ttft_ms_p50']} ms, ITL p50 / p99 {d['itl_ms_p50']} / "
                       f"{d['itl_ms_p99']} ms |")
        elif w == "core_overhead":
            out.append(f"| core_overhead {d.get('dataplane')} {label} | TTFT p50 {d['ttft_p50_ms']} ms "
                       f"(min {d['ttft_min_ms']}), ITL p50 {d['itl_p50_ms']} ms |")
        if d.get("first_token_ms", {}).get("requests"):
            f = d["first_token_ms"]
            stages = ", ".join(f"{k} {f[k]:.2f}" for k in STAGES)
            out.append(f"| first token ({w} {label}) | {stages}; sum {f['sum']:.2f} / TTFT {f['ttft']:.2f} ms |")
    w1 = {d.get("stream_interval"): d for d in lines if d.get("workload") == "w1" and d.get("api") == "grpc"}
    offline, streamed = w1.get(100000), w1.get(0)
    if offline and streamed:
        out.append(f"| W1 streamed / offline | {streamed['output_tok_per_s']:.0f} / {offline['output_tok_per_s']:.0f} "
                   f"tok/s = {streamed['output_tok_per_s'] / offline['output_tok_per_s']:.1%} (target >= 95%); "
                   f"streamed client: {streamed.get('client_processes')} processes, busiest "
                   f"{streamed.get('client_cpu_max')} CPU, limited: {streamed.get('client_limited')} |")
    served = {}
    for d in lines:
        if d.get("workload") != "w4":
            continue
        n = d["api_server_count"]
        out.append(f"| W4 N={n} | highest rate at the SLO: {d['max_rate_at_slo']} req/s (target >= 140) |")
        for r in d["rates"]:
            served[(n, r["rate"])] = r["request_per_s"]
            out.append(f"| W4 N={n} @ {r['rate']:g} | served {r['request_per_s']} req/s, TTFT {r['ttft_ms_p50']} / "
                       f"{r['ttft_ms_p99']}, ITL {r['itl_ms_p50']} / {r['itl_ms_p99']} ms, SLO "
                       f"{'met' if r['meets_slo'] else 'missed'}; client CPU max {r.get('client_cpu_max')}; "
                       f"device idle {r.get('device_idle_share')}; exec/dev ms {_kinds(r)} |")
    for (n, rate), value in sorted(served.items()):
        if n == 4 and (1, rate) in served and served[(1, rate)]:
            out.append(f"| W4 @ {rate:g}: N=4 / N=1 served | {value / served[(1, rate)]:.2f}x (target >= 1.6x "
                       "where the front ends are the limit) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="the JSON lines of a gpu_run.sh call (results.jsonl)")
    print(table(_lines(ap.parse_args(argv).results)))


if __name__ == "__main__":
    main()
