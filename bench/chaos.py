"""Issue 52's fault-injection experiments at its sizes, on a real ``headrace serve`` tree (the
embedded model on the CPU, two API front ends, the server's default watchdog settings): 8
streams of 200 tokens in flight while

- a poisoned request (its sampling raises: ``HEADRACE_FAILPOINTS`` on the sampler, by seed)
  runs beside 7 of them;
- 400 streams are abandoned after their first token;
- the data plane is stopped (SIGSTOP) for 20 s; the engine core and a front end for 5 s;
- the data plane, the engine core (greedy and seeded sampled streams) and a front end are
  killed (-9);
- Ctrl-C reaches serve with 8 HTTP streams of 900 tokens open (drain timeout 10 s);

then the server's log is read (longest line, lines over 8 KB or without ``role``, prompt token
ids). One JSON line per experiment, then a table of the issue's targets. The experiments are
``tests/chaos.py``'s (``tests/test_chaos.py`` runs them smaller).

    python -m bench.chaos [--streams 8] [--tokens 200] [--stop-seconds 20] [--only poisoned,kill_core]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

EXPERIMENTS = ("poisoned", "abandoned", "stop_dataplane", "stop_core", "stop_frontend",
               "kill_dataplane", "kill_core", "kill_core_seeded", "kill_frontend", "logs", "ctrl_c")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--stop-seconds", type=float, default=20.0, help="the data plane's SIGSTOP")
    ap.add_argument("--abandoned", type=int, default=400)
    ap.add_argument("--drain-timeout", type=float, default=10.0)
    ap.add_argument("--ctrl-c-tokens", type=int, default=900)
    ap.add_argument("--only", default="", help=f"comma-separated, of {', '.join(EXPERIMENTS)}")
    args = ap.parse_args()

    import grpc

    from tests import chaos
    from tests.served import Served, free_port

    only = set(filter(None, args.only.split(","))) or set(EXPERIMENTS)
    results: dict[str, dict] = {}
    tmp = tempfile.mkdtemp(prefix="headrace-chaos-")

    def report(name: str, out: dict) -> None:
        results[name] = out
        print(json.dumps({"experiment": name, **out}, default=str), flush=True)

    http = free_port()
    served = Served(f"{tmp}/serve.log", api_server_count=2,
                    extra=chaos.serve_argv_extra(http, drain_s=args.drain_timeout),
                    env={"HEADRACE_FAILPOINTS": chaos.FAILPOINTS})
    served.http_port = http
    try:
        served.wait_serving()
        expected = chaos.reference(served, args.streams, args.tokens)
        n, t = args.streams, args.tokens
        if "poisoned" in only:
            report("poisoned", chaos.poisoned(served, expected, t))
        if "abandoned" in only:
            report("abandoned", chaos.abandoned(served, args.abandoned, t))
        if "stop_dataplane" in only:
            report("stop_dataplane", chaos.stop(served, "dataplane", expected, t, args.stop_seconds))
        if "stop_core" in only:
            report("stop_core", chaos.stop(served, "core", expected, t, 5.0))
        if "stop_frontend" in only:
            report("stop_frontend", chaos.stop(served, "frontend 0", expected, t, 5.0))
        if "kill_dataplane" in only:
            report("kill_dataplane", chaos.kill(served, "dataplane", expected, t))
        if "kill_core" in only:
            report("kill_core", chaos.kill(served, "core", expected, t))
        if "kill_core_seeded" in only:
            seeded = chaos.reference(served, n, t, seeded=True)
            report("kill_core_seeded", chaos.kill(served, "core", seeded, t, seeded=True))
        if "kill_frontend" in only:
            report("kill_frontend", chaos.kill(served, "frontend 0", expected, t))
        if "logs" in only:
            from headrace.v1 import inference_pb2 as pb
            from headrace.v1 import inference_pb2_grpc as pb_grpc

            with grpc.insecure_channel(served.address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                ids = [list(stub.Tokenize(pb.TokenizeRequest(text=p), timeout=10).token_ids)
                       for p in chaos.prompts(n)]
            served.log.flush()
            report("logs", chaos.check_logs(served.log.name, ids))
        if "ctrl_c" in only:
            report("ctrl_c", chaos.ctrl_c(served, n, args.ctrl_c_tokens, args.drain_timeout))
    finally:
        served.close()
    table(results, args)


def _row(target: str, figure, met: bool | None) -> str:
    mark = "" if met is None else ("met" if met else "NOT MET")
    return f"| {target} | {figure} | {mark} |"


def table(r: dict, args) -> None:
    rows = ["| target | measured | |", "| --- | --- | --- |"]
    if "poisoned" in r:
        p = r["poisoned"]
        code = p["poisoned_error"][0] if p["poisoned_error"] else "none"
        rows.append(_row("poisoned request: INTERNAL within 5 s", f"{code} after {p['poisoned_failed_after_s']} s",
                         code == "INTERNAL" and p["poisoned_failed_after_s"] < 5))
        rows.append(_row("the other streams finish all their tokens", f"{p['same_tokens']}/{p['streams']}",
                         p["same_tokens"] == p["streams"]))
        rows.append(_row("log growth under 200 KB", f"{p['log_growth_bytes'] / 1000:.1f} KB",
                         p["log_growth_bytes"] < 200_000))
        rows.append(_row("a request after it is served", p["next_request_ok"], p["next_request_ok"]))
    if "stop_dataplane" in r:
        s = r["stop_dataplane"]
        rows.append(_row(f"SIGSTOP data plane {args.stop_seconds:g} s: NOT_SERVING within 10 s",
                         f"{s['not_serving_after_s']} s (/ready 503 after {s['ready_503_after_s']} s)",
                         s["not_serving_after_s"] is not None and s["not_serving_after_s"] < 10))
        rows.append(_row("... after SIGCONT every stream completes", f"{s['same_tokens']}/{s['streams']}",
                         s["same_tokens"] == s["streams"]))
    for name, label in (("kill_core", "kill -9 core: same tokens as undisturbed (greedy)"),
                        ("kill_core_seeded", "kill -9 core: same tokens (seeded sampling)"),
                        ("kill_dataplane", "kill -9 data plane: same tokens"),
                        ("stop_core", "SIGSTOP core 5 s: same tokens"),
                        ("stop_frontend", "SIGSTOP front end 5 s: same tokens")):
        if name in r:
            k = r[name]
            rows.append(_row(label, f"{k['same_tokens']}/{k['streams']}, errors {len(k['errors'])}, "
                             f"longest pause {k['longest_gap_s']} s",
                             k["same_tokens"] == k["streams"] and not k["errors"]))
    if "kill_frontend" in r:
        k = r["kill_frontend"]
        rows.append(_row("kill -9 front end: its streams fail explicitly, the others finish",
                         f"{k['victim_errors']}; others {k['others_same']}/{k['streams'] // 2}",
                         k["hung"] == 0 and k["others_same"] == k["streams"] // 2))
    if "abandoned" in r:
        a = r["abandoned"]
        rows.append(_row(f"{a['abandoned']} abandoned streams leave nothing", f"in flight {a['in_flight_after']}, "
                         f"KV {a['kv_usage_after']}, RSS growth MB {a['rss_growth_mb']}",
                         a["in_flight_after"] == 0 and a["kv_usage_after"] == 0))
    if "ctrl_c" in r:
        c = r["ctrl_c"]
        rows.append(_row(f"Ctrl-C, {c['streams']} HTTP streams: a last event and [DONE] within the drain timeout",
                         f"{c['done_events']} [DONE], {c['error_events']} error events, "
                         f"last at {c['last_stream_end_s']} s (drain {c['drain_timeout_s']:g} s)",
                         c["done_events"] == c["streams"] and c["last_stream_end_s"] <= c["drain_timeout_s"]))
        rows.append(_row("process tree gone within drain + 3 s", f"{c['tree_gone_s']} s",
                         c["tree_gone_s"] is not None and c["tree_gone_s"] <= c["drain_timeout_s"] + 3))
        rows.append(_row("no traceback", f"{c['tracebacks_after_signal']} lines", c["tracebacks_after_signal"] == 0))
    if "logs" in r:
        g = r["logs"]
        rows.append(_row("no log line over 8 KB; role on every line; no prompt token ids",
                         f"longest {g['longest_line']} B, {g['over_8kb']} over, {g['without_role']} without role, "
                         f"{g['prompt_ids_found']} prompts' ids", g["over_8kb"] == 0 and g["without_role"] == 0
                         and g["prompt_ids_found"] == 0))
    print("\n".join(rows))


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
