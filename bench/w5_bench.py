"""W5: multi-turn chat (issue 23). Conversations share a system prompt; each turn sends the
whole history so far (system prompt, every earlier user message and reply) plus a new user
message of ~300 tokens and generates ~150 tokens (greedy, streamed over gRPC). The turns of
different conversations are interleaved (round robin, ``--concurrency`` in flight) and the
device KV pool is limited (``--num-kv-blocks``) so it cannot keep every history: without a
second tier a returning conversation's history is evicted and recomputed; with
``--kv-offloading-size`` it comes back from host memory, or is recomputed where the cost rule
(``--kv-offloading-policy``, ``controlplane.tier_cost``) finds that cheaper.

    python -m bench.w5_bench --model /tmp/qwen3 --num-kv-blocks 8192 --offload-gib 48

Runs every mode of ``--modes`` (default ``off,auto,always``: no host tier, then a host tier
under each ``--kv-offloading-policy``; ``never`` too; ``on`` means ``auto``) against a fresh
``headrace serve`` each, in this one invocation, and prints one JSON line per mode: TTFT p50 /
p99 (all turns, and turns after the first), output and total token throughput, the
prefix-cache hit rate per tier (from the control plane's /metrics: tokens found on the device
/ on the host over prompt tokens looked up), the host-hit tokens the cost rule recomputed and
its estimates (load and recompute seconds per token); then a short table, with each mode's
TTFT p50 over the ``off`` one's, and whether every mode generated the same tokens. Tiny sizes
run on a CPU (``--device cpu --conversations 4 --turns 3 --user-tokens 40 --output-tokens 8``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request

from bench.w4_bench import quantile, stop_server


def conversations(args) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per conversation, its users' messages (token ids), seeded; each
    message's length varies +-20% around ``--user-tokens``."""
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randint(10, args.vocab - 1) for _ in range(n)]  # noqa: E731
    system = tok(args.system_tokens)
    users = [[tok(max(1, int(args.user_tokens * rng.uniform(0.8, 1.2)))) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


async def _turn(stub, pb, prompt: list[int], max_tokens: int) -> dict:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0))
    sent, first, tokens, cached = time.perf_counter(), None, [], 0
    async for resp in stub.Generate(req, timeout=1800):
        if first is None and resp.token_ids:
            first = time.perf_counter()
        tokens.extend(resp.token_ids)
        if resp.HasField("usage"):
            cached = resp.usage.cached_prompt_tokens
    return {"ttft": (first or time.perf_counter()) - sent, "tokens": tokens, "cached": cached,
            "prompt": len(prompt)}


async def run_workload(address: str, args) -> dict:
    import grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    system, users = conversations(args)
    history = [list(system) for _ in users]
    turns: list[dict] = []
    # round robin: turn t of every conversation before turn t + 1 of any, --concurrency at once
    order = [(c, t) for t in range(args.turns) for c in range(len(users))]
    done = {c: -1 for c in range(len(users))}
    ready = asyncio.Condition()
    gate = asyncio.Semaphore(args.concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await _turn(stub, pb, [1, 2, 3], 2)   # warm-up

        async def one(c: int, t: int) -> None:
            async with ready:
                await ready.wait_for(lambda: done[c] == t - 1)
            async with gate:
                prompt = history[c] + users[c][t]
                r = await _turn(stub, pb, prompt, args.output_tokens)
            history[c] = prompt + r["tokens"]
            r.update(conversation=c, turn=t)
            turns.append(r)
            async with ready:
                done[c] = t
                ready.notify_all()

        start = time.perf_counter()
        await asyncio.gather(*(one(c, t) for c, t in order))
        wall = time.perf_counter() - start
    later = [r["ttft"] for r in turns if r["turn"] > 0]
    ms = lambda x: round(x * 1e3, 2)  # noqa: E731
    out_tokens = sum(len(r["tokens"]) for r in turns)
    prompt_tokens = sum(r["prompt"] for r in turns)
    return {"turns": len(turns), "wall_s": round(wall, 2),
            "ttft_ms_p50": ms(quantile([r["ttft"] for r in turns], .5)),
            "ttft_ms_p99": ms(quantile([r["ttft"] for r in turns], .99)),
            "later_turns_ttft_ms_p50": ms(quantile(later, .5)),
            "later_turns_ttft_ms_p99": ms(quantile(later, .99)),
            "output_tok_per_s": round(out_tokens / wall, 1),
            "total_tok_per_s": round((out_tokens + prompt_tokens) / wall, 1),
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": sum(r["cached"] for r in turns),
            # equal in two modes: the same tokens were generated (greedy)
            "histories_digest": hashlib.sha256(json.dumps(history).encode()).hexdigest()[:16]}


MODES = ("off", "auto", "always", "never")
_METRIC = re.compile(r'headrace:(prefix_cache_queries_total|kv_tier_prefix_hits_total\{tier="(\w+)"\}|'
                     r'kv_offload_blocks_total\{direction="(\w+)"\}|kv_offload_copy_seconds_total|'
                     r'kv_tier_host_hits_recomputed_total|kv_tier_seconds_per_token\{action="(\w+)"\}) (\S+)')


def tier_hits(metrics_port: int) -> dict:
    """Prefix-cache tokens looked up, and found per tier; blocks copied each way; host hits
    recomputed; the cost rule's estimates (``s_per_token_load`` / ``_recompute``), from the
    control plane's /metrics."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            key = (m.group(2) or (m.group(3) and "blocks_" + m.group(3))
                   or (m.group(4) and "s_per_token_" + m.group(4)) or m.group(1).replace("_total", ""))
            out[key] = float(m.group(5))
    return out


def start_server(args, mode: str):
    cmd = [sys.executable, "-m", "cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--http-port", "0", "--metrics-port", str(args.metrics_port),
           "--dataplane-metrics-port", "0", "--api-server-count", "1", "--device", args.device,
           "--num-kv-blocks", str(args.num_kv_blocks), *args.serve_args.split()]
    if mode != "off":
        cmd += ["--kv-offloading-size", str(args.offload_gib), "--kv-offloading-policy", mode]
    return subprocess.Popen(cmd, env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"), start_new_session=True)


def run_mode(args, mode: str) -> dict:
    from headrace_client import AsyncClient, NotReady

    server = start_server(args, mode) if args.address is None else None
    address = args.address or f"127.0.0.1:{args.port}"
    try:
        try:
            asyncio.run(AsyncClient(address).wait_ready(args.ready_timeout))
        except NotReady as exc:
            raise SystemExit(f"w5 ({mode}): {exc}") from None
        before = tier_hits(args.metrics_port)
        row = asyncio.run(run_workload(address, args))
        after = tier_hits(args.metrics_port)
    finally:
        if server is not None:
            stop_server(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    looked = delta.get("prefix_cache_queries", 0.0)
    row.update(workload="w5", offloading=mode, num_kv_blocks=args.num_kv_blocks,
               offload_gib=args.offload_gib if mode != "off" else 0,
               hit_rate_device=round(delta.get("device", 0.0) / looked, 4) if looked else None,
               hit_rate_host=round(delta.get("host", 0.0) / looked, 4) if looked else None,
               blocks_out=int(delta.get("blocks_out", 0)), blocks_in=int(delta.get("blocks_in", 0)),
               copy_s=round(delta.get("kv_offload_copy_seconds", 0.0), 3),
               host_hits_recomputed=int(delta.get("kv_tier_host_hits_recomputed", 0)),
               load_us_per_token=round(after.get("s_per_token_load", 0.0) * 1e6, 3),
               recompute_us_per_token=round(after.get("s_per_token_recompute", 0.0) * 1e6, 3))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--address", default=None, help="use a running server (one mode) instead of starting one")
    ap.add_argument("--port", type=int, default=50171)
    ap.add_argument("--metrics-port", type=int, default=50173, help="the control plane's /metrics")
    ap.add_argument("--modes", default="off,auto,always",
                    help="in this order: off (no host tier), and a host tier under each "
                         "--kv-offloading-policy named: auto, always, never (on: auto)")
    ap.add_argument("--num-kv-blocks", type=int, default=8192,
                    help="the device KV pool (blocks of 16; W5's histories reach ~470k tokens)")
    ap.add_argument("--offload-gib", type=float, default=48.0, help="--kv-offloading-size when on")
    ap.add_argument("--serve-args", default="--max-running 256 --max-batched-tokens 8192",
                    help="more `headrace serve` options")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32, help="turns in flight at once")
    ap.add_argument("--system-tokens", type=int, default=200, help="the shared system prompt")
    ap.add_argument("--user-tokens", type=int, default=300, help="new user tokens per turn (mean)")
    ap.add_argument("--output-tokens", type=int, default=150, help="tokens generated per turn")
    ap.add_argument("--vocab", type=int, default=2000, help="token ids are drawn below this")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model is None:
        from cli.options import default_model
        args.model = default_model()
    modes = [{"on": "auto"}.get(m.strip(), m.strip()) for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma-separated list of {', '.join(MODES)}")
    rows = []
    for mode in modes:
        rows.append(run_mode(args, mode))
        print(json.dumps(rows[-1]), flush=True)
    table(rows)


def table(rows: list[dict]) -> None:
    off = next((r["ttft_ms_p50"] for r in rows if r["offloading"] == "off"), None)
    print(f"{'offload':>8} {'TTFT p50':>9} {'vs off':>7} {'p99':>9} {'later p50':>9} {'tok/s':>8} "
          f"{'dev hit':>8} {'host hit':>8} {'recomp.':>8} {'load us':>8} {'recomp us':>9}")
    for r in rows:
        ratio = f"{off / r['ttft_ms_p50']:.2f}x" if off and r["ttft_ms_p50"] else "-"
        print(f"{r['offloading']:>8} {r['ttft_ms_p50']:>9} {ratio:>7} {r['ttft_ms_p99']:>9} "
              f"{r['later_turns_ttft_ms_p50']:>9} {r['output_tok_per_s']:>8} {r['hit_rate_device']!s:>8} "
              f"{r['hit_rate_host']!s:>8} {r['host_hits_recomputed']:>8} {r['load_us_per_token']:>8} "
              f"{r['recompute_us_per_token']:>9}")
    same = len({r["histories_digest"] for r in rows}) == 1
    print(f"same tokens in every mode: {'yes' if same else 'NO'} (vs off: off's TTFT p50 over the mode's)")


if __name__ == "__main__":
    main()
