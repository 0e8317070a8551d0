"""Data parallelism on one GPU (docs/scaling.md): two replicas of the model sharing it
(``headrace serve --data-parallel-size 2``, each with its share of the memory).

- ``parity`` (with ``w1``, on its servers): greedy completions of a few prompts from two
  replicas equal one replica's.
- ``w4s``, a multi-tenant shared-prefix variant of W4: ``--tenants`` tenants, each with its
  own system prompt (``--prefix-tokens``), each request that prompt plus its own question
  (lognormal, mean ~150) and a lognormal answer (mean ~150); Poisson arrivals at each of
  ``--rates``, every token streamed by 4 client processes (``bench.w4_bench``). Run once per
  placement (prefix, round-robin), each on a fresh server whose replicas hold
  ``--num-kv-blocks`` blocks: about half of all tenants' prompts, so where a tenant's requests
  go decides whether its prompt stays cached. Reports TTFT / ITL p50 and p99, throughput, the
  prefix-cache hit rate (the server's /metrics) and the placements by reason.
- ``w1``: nano-vllm's offline throughput (``bench.serving_bench``) on two replicas against one
  replica with the whole GPU.

Prints one JSON line per run, then a table of the targets: prefix over round robin TTFT p50
(>= 1.5x) and DP = 2 over DP = 1 W1 throughput (>= 0.9x).

    python -m bench.dp_bench --model /tmp/qwen3 --parts parity,w4s,w1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

from bench import w4_bench

PLACEMENTS = ("prefix", "round-robin")


def shared_prefix_items(rate: float, duration: float, tenants: int, prefix_tokens: int, seed: int,
                        top_id: int = 20000):
    """[(send offset s, prompt ids, max_tokens)]: Poisson arrivals, tenant by Zipf popularity."""
    rng = random.Random(seed)
    prompts = [[rng.randint(10, top_id) for _ in range(prefix_tokens)] for _ in range(tenants)]
    weights = [1 / (k + 1) for k in range(tenants)]
    questions = w4_bench.lengths(int(rate * duration) + 1, 150, seed + 1, sigma=0.8, high=600)
    answers = w4_bench.lengths(int(rate * duration) + 1, 150, seed + 2, sigma=0.8, high=600)
    t, out = 0.0, []
    for q, a in zip(questions, answers):
        tenant = rng.choices(range(tenants), weights)[0]
        out.append((t, prompts[tenant] + [rng.randint(10, top_id) for _ in range(q)], a))
        t += rng.expovariate(rate)
    return out


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("headrace:") and " " in line:
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def serve(args, serve_args: str, extra: list[str]):
    """``headrace serve`` on --port (its /metrics on --port + 2), ready; (process, seconds)."""
    cmd = [sys.executable, "-P", "-m", "headrace.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--http-port", "0", "--metrics-port", str(args.port + 2),
           "--dataplane-metrics-port", "0", *serve_args.split(), *extra]
    server = subprocess.Popen(cmd, env={**os.environ, "HEADRACE_LOG_LEVEL": "WARNING"},
                              start_new_session=True)
    from headrace.client import Client

    t0 = time.perf_counter()
    with Client(f"127.0.0.1:{args.port}") as client:
        client.wait_ready(900)
    return server, round(time.perf_counter() - t0, 1)


def parity_outputs(address: str, top_id: int) -> list[list[int]]:
    from headrace.client import Client

    rng = random.Random(7)
    prompts = [[rng.randint(10, top_id) for _ in range(rng.randint(20, 300))] for _ in range(6)]
    with Client(address) as client:
        return [client.generate(token_ids=p, max_tokens=32, temperature=0, ignore_eos=True).token_ids
                for p in prompts]


def w4s(args) -> list[dict]:
    rows = []
    blocks = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    for placement in PLACEMENTS:
        server, ready = serve(args, args.serve_args, ["--data-parallel-size", "2",
                                                      "--data-parallel-placement", placement, *blocks])
        try:
            address = f"127.0.0.1:{args.port}"
            warm = argparse.Namespace(**{**vars(args), "duration": 2.0})
            w4_bench.run_rate(address, 2.0, warm, shared_prefix_items(2.0, 2.0, 4, 64, 99, args.top_id))
            for rate in args.rates:
                before = scrape(args.port + 2)
                items = shared_prefix_items(rate, args.duration, args.tenants, args.prefix_tokens,
                                            args.seed, args.top_id)
                row = w4_bench.run_rate(address, rate, args, items)
                after = scrape(args.port + 2)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                queries = delta.get("headrace:prefix_cache_queries_total", 0.0)
                row.update(part="w4s", placement=placement, seconds_to_ready=ready,
                           hit_rate=round(delta.get("headrace:prefix_cache_hits_total", 0.0) / queries, 4)
                           if queries else None,
                           placements={k.split("{", 1)[1].rstrip("}"): v for k, v in delta.items()
                                       if k.startswith("headrace:placements_total{") and v})
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            w4_bench.stop_server(server)
    return rows


def w1(args, check_parity: bool) -> tuple[list[dict], dict | None]:
    """W1 on one replica with the whole GPU, then on two sharing it; greedy parity between them."""
    rows, outputs = [], []
    for dp in (1, 2):
        server, ready = serve(args, args.w1_serve_args, ["--data-parallel-size", str(dp)])
        try:
            address = f"127.0.0.1:{args.port}"
            if check_parity:
                outputs.append(parity_outputs(address, args.top_id))
            out = subprocess.run([sys.executable, "-m", "bench.serving_bench", "--workload", "w1",
                                  "--address", address], capture_output=True, text=True, timeout=600)
        finally:
            w4_bench.stop_server(server)
        line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
        row = dict(json.loads(line) if line else {"error": out.stderr[-500:]}, part="w1", dp=dp,
                   seconds_to_ready=ready)
        rows.append(row)
        print(json.dumps(row), flush=True)
    same = {"part": "parity", "prompts": len(outputs[0]), "equal_dp1_dp2": sum(
        a == b for a, b in zip(*outputs))} if check_parity else None
    if same:
        print(json.dumps(same), flush=True)
    return rows, same


def table(parity_row, w4s_rows, w1_rows) -> str:
    lines = ["| measure | value | target |", "| --- | ---: | --- |"]
    if parity_row:
        lines.append(f"| greedy completions equal, DP=2 vs DP=1 | {parity_row['equal_dp1_dp2']}/"
                     f"{parity_row['prompts']} | all (bf16 noise may split late tokens) |")
    for rate in sorted({r["rate"] for r in w4s_rows}):
        by = {r["placement"]: r for r in w4s_rows if r["rate"] == rate}
        if len(by) == 2:
            p, rr = by["prefix"], by["round-robin"]
            for r in (p, rr):
                lines.append(f"| W4S {rate:g} req/s {r['placement']}: TTFT p50 / p99 ms, hit rate | "
                             f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']}, {r['hit_rate']} | |")
            ratio = rr["ttft_ms_p50"] / p["ttft_ms_p50"] if p["ttft_ms_p50"] else float("nan")
            lines.append(f"| W4S {rate:g} req/s: round-robin / prefix TTFT p50 | {ratio:.2f}x | >= 1.5x |")
    tput = {r["dp"]: r.get("output_tok_per_s") for r in w1_rows}
    if tput.get(1) and tput.get(2):
        lines.append(f"| W1 tok/s DP=1 (whole GPU) / DP=2 (shared) | {tput[1]:.0f} / {tput[2]:.0f} | |")
        lines.append(f"| W1 DP=2 / DP=1 | {tput[2] / tput[1]:.2f}x | >= 0.9x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--parts", default="parity,w4s,w1")
    ap.add_argument("--port", type=int, default=50171)
    ap.add_argument("--serve-args", default="--device cuda --max-running 256 --max-batched-tokens 8192",
                    help="W4S's servers (W4's)")
    ap.add_argument("--w1-serve-args", default="--device cuda --max-running 256 --max-batched-tokens 16384",
                    help="W1's servers (nano-vllm's step budget, as bench.serving_bench)")
    ap.add_argument("--rates", default="20,40", help="W4S request rates (req/s), comma-separated")
    ap.add_argument("--duration", type=float, default=10.0, help="W4S seconds of arrivals per rate")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="each tenant's system prompt")
    ap.add_argument("--num-kv-blocks", type=int, default=2048,
                    help="W4S: KV blocks per replica (2048 x 16 tokens: about half the tenants' prompts)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-id", type=int, default=20000, help="prompts' token ids are below it")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    parts = args.parts.split(",")
    rows1, same = w1(args, "parity" in parts) if "w1" in parts else ([], None)
    rows4 = w4s(args) if "w4s" in parts else []
    print(table(same, rows4, rows1))


if __name__ == "__main__":
    main()
