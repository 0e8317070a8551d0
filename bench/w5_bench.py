"""W5: multi-turn chat (issues 23, 33). Conversations share a system prompt; each turn sends
the whole history so far (system prompt, every earlier user message and reply) plus a new user
message of ~300 tokens and generates ~150 tokens (greedy, streamed over gRPC). The turns of
different conversations are interleaved (round robin, ``--concurrency`` in flight) and the
device KV pool is limited (``--num-kv-blocks``) so it cannot keep every history: without a
second tier a returning conversation's history is evicted and recomputed; with
``--kv-offloading-size`` it comes back from host memory, or is recomputed where the cost rule
(``--kv-offloading-policy``, ``headrace.controlplane.kv.tier_cost``) finds that cheaper.

    python -m bench.w5_bench --model /tmp/qwen3 --num-kv-blocks 2048 --offload-gib 24

Runs every mode of ``--modes`` (default ``off,auto,always``; ``never`` too; ``on`` means
``auto``; a mode may repeat, and ``MODE/alone`` runs the first ``--alone-conversations``
turn by turn, one turn at a time) in this one invocation, against one data plane started with
the host tier (``--offload-gib``) and a fresh control plane per mode (``off`` is
``--kv-offloading-policy off``: the tier unused; the device and its compiled kernels are the
same for every mode); ``--fresh-server`` starts a whole ``headrace serve`` per mode instead
(``off`` then has no tier at all). Each mode first plays a few warm-up turns of other
conversations. Prints one JSON line per mode: TTFT p50 / p99 (all turns, and turns after the
first), output and total token throughput, the prefix-cache hit rate per tier (from the
control plane's /metrics: tokens found on the device / on the host over prompt tokens looked
up), the host-hit tokens the cost rule recomputed and its estimates (load and recompute
seconds per token), and how its generated tokens compare with the first mode of its kind
(conversations identical, and where the others first differ: turn and token); then a short
table, with each mode's TTFT p50 and throughput over ``off``'s.

Why modes can differ at all (docs/kv_offloading.md, *Exactness*): in bfloat16 a token's
logits depend on the batch it was computed in (GEMM and attention tiles and splits change with
the batch's shape) and on whether its history's KV was loaded (computed by the decode steps
that produced it) or recomputed (by a prefill); greedy decoding turns a last-bit difference at
a near-tie into another token, and every later token of that conversation follows. Two runs of
the same mode differ the same way (``--modes off,off``). ``/alone`` fixes the batch (one turn
at a time): what is left is loaded against recomputed KV. A wrong block would show as
conversations that differ from their first turns on, in every run. Tiny sizes run on a CPU
(``--device cpu --conversations 4 --turns 3 --user-tokens 40 --output-tokens 8``).

``--deterministic`` serves in that mode (batch-invariant kernels, docs/determinism.md): then
every mode must give every conversation the same tokens and the same logprobs (the turns ask
for them; ``histories_digest`` covers both), which is issue 54's W5 target.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from bench.ready import wait_ready
from bench.w4_bench import quantile, stop_server
from bench.w5_report import compare, table, tier_hits


def conversations(args, seed: int | None = None) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per conversation, its users' messages (token ids), seeded; each
    message's length varies +-20% around ``--user-tokens``."""
    rng = random.Random(args.seed if seed is None else seed)
    tok = lambda n: [rng.randint(10, args.vocab - 1) for _ in range(n)]  # noqa: E731
    system = tok(args.system_tokens)
    users = [[tok(max(1, int(args.user_tokens * rng.uniform(0.8, 1.2)))) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


async def _turn(stub, pb, prompt: list[int], max_tokens: int, logprobs: bool = False) -> dict:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0),
                             logprobs=int(logprobs))
    sent, first, tokens, cached, lps = time.perf_counter(), None, [], 0, []
    async for resp in stub.Generate(req, timeout=1800):
        if first is None and resp.token_ids:
            first = time.perf_counter()
        tokens.extend(resp.token_ids)
        lps.extend(lp.logprob for lp in resp.logprobs)
        if resp.HasField("usage"):
            cached = resp.usage.cached_prompt_tokens
    return {"ttft": (first or time.perf_counter()) - sent, "tokens": tokens, "cached": cached,
            "prompt": len(prompt), "logprobs": lps}


async def _play(stub, pb, system, users, turns_per_conv: int, concurrency: int, output_tokens: int,
                logprobs: bool = False) -> list[dict]:
    """Every conversation's turns, round robin (turn t of every conversation before turn t + 1
    of any), ``concurrency`` turns at once; each turn's record, with its conversation's tokens."""
    history = [list(system) for _ in users]
    turns: list[dict] = []
    order = [(c, t) for t in range(turns_per_conv) for c in range(len(users))]
    done = {c: -1 for c in range(len(users))}
    ready = asyncio.Condition()
    gate = asyncio.Semaphore(concurrency)

    async def one(c: int, t: int) -> None:
        async with ready:
            await ready.wait_for(lambda: done[c] == t - 1)
        async with gate:
            prompt = history[c] + users[c][t]
            r = await _turn(stub, pb, prompt, output_tokens, logprobs)
        history[c] = prompt + r["tokens"]
        r.update(conversation=c, turn=t)
        turns.append(r)
        async with ready:
            done[c] = t
            ready.notify_all()

    await asyncio.gather(*(one(c, t) for c, t in order))
    return turns


async def run_workload(address: str, args, alone: bool = False) -> dict:
    import grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc

    system, users = conversations(args)
    if alone:
        users = users[:args.alone_conversations]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await _turn(stub, pb, [1, 2, 3], 2)
        if args.warmup_conversations:   # other tokens: nothing of them is reused by the timed run
            w_system, w_users = conversations(args, seed=args.seed + 1)
            await _play(stub, pb, w_system, w_users[:args.warmup_conversations], 2,
                        args.warmup_conversations, min(args.output_tokens, 16))
        start = time.perf_counter()
        turns = await _play(stub, pb, system, users, args.turns, 1 if alone else args.concurrency,
                            args.output_tokens, args.deterministic)
        wall = time.perf_counter() - start
    later = [r["ttft"] for r in turns if r["turn"] > 0]
    ms = lambda x: round(x * 1e3, 2)  # noqa: E731
    out_tokens = sum(len(r["tokens"]) for r in turns)
    prompt_tokens = sum(r["prompt"] for r in turns)
    outputs = [[[] for _ in range(args.turns)] for _ in users]   # [conversation][turn] -> tokens
    logprobs = [[[] for _ in range(args.turns)] for _ in users]  # (--deterministic) their logprobs
    for r in turns:
        outputs[r["conversation"]][r["turn"]] = r["tokens"]
        logprobs[r["conversation"]][r["turn"]] = r["logprobs"]
    return {"turns": len(turns), "wall_s": round(wall, 2),
            "ttft_ms_p50": ms(quantile([r["ttft"] for r in turns], .5)),
            "ttft_ms_p99": ms(quantile([r["ttft"] for r in turns], .99)),
            "later_turns_ttft_ms_p50": ms(quantile(later, .5)),
            "later_turns_ttft_ms_p99": ms(quantile(later, .99)),
            "output_tok_per_s": round(out_tokens / wall, 1),
            "total_tok_per_s": round((out_tokens + prompt_tokens) / wall, 1),
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": sum(r["cached"] for r in turns),
            # equal in two modes: the same tokens (and logprobs, with --deterministic) were generated
            "histories_digest": hashlib.sha256(json.dumps(
                [outputs, logprobs] if args.deterministic else outputs).encode()).hexdigest()[:16],
            "_outputs": outputs, "_logprobs": logprobs}


MODES = ("off", "auto", "always", "never")
def _launch(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-m", "headrace.cli", *cmd], env=dict(os.environ, HEADRACE_LOG_LEVEL="WARNING"),
                            start_new_session=True)


def _public(args) -> list[str]:
    return ["--model", args.model, "--host", "127.0.0.1", "--port", str(args.port), "--http-port", "0",
            "--metrics-port", str(args.metrics_port), "--api-server-count", "1", *args.serve_args.split(),
            *(["--deterministic"] if args.deterministic else [])]


def start_server(args, mode: str) -> subprocess.Popen:
    """A whole ``headrace serve`` for one mode (``--fresh-server``)."""
    cmd = ["serve", *_public(args), "--dataplane-metrics-port", "0", "--device", args.device,
           "--num-kv-blocks", str(args.num_kv_blocks)]
    if mode != "off":
        cmd += ["--kv-offloading-size", str(args.offload_gib), "--kv-offloading-policy", mode]
    return _launch(cmd)


def start_dataplane(args, listen: str) -> subprocess.Popen:
    """The one data plane every mode's control plane steps (with the host tier)."""
    return _launch(["dataplane", "--model", args.model, "--listen", listen, "--metrics-port", "0",
                    "--device", args.device, "--num-kv-blocks", str(args.num_kv_blocks),
                    "--kv-offloading-size", str(args.offload_gib), *args.serve_args.split(),
                    *(["--deterministic"] if args.deterministic else [])])


def start_controlplane(args, mode: str, workers: str) -> subprocess.Popen:
    return _launch(["controlplane", *_public(args), "--workers", workers, "--kv-offloading-policy", mode])


def run_mode(args, mode: str, alone: bool, workers: str | None) -> dict:
    server = None
    if args.address is None:
        server = start_server(args, mode) if workers is None else start_controlplane(args, mode, workers)
    address = args.address or f"127.0.0.1:{args.port}"
    try:
        wait_ready(address, server, args.ready_timeout)
        before = tier_hits(args.metrics_port)
        row = asyncio.run(run_workload(address, args, alone))
        after = tier_hits(args.metrics_port)
    finally:
        if server is not None:
            stop_server(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    looked = delta.get("prefix_cache_queries", 0.0)
    row.update(workload="w5", model=os.path.basename(args.model.rstrip("/")), deterministic=args.deterministic,
               offloading=mode + ("/alone" if alone else ""), num_kv_blocks=args.num_kv_blocks,
               offload_gib=args.offload_gib if mode != "off" else 0,
               hit_rate_device=round(delta.get("device", 0.0) / looked, 4) if looked else None,
               hit_rate_host=round(delta.get("host", 0.0) / looked, 4) if looked else None,
               blocks_out=int(delta.get("blocks_out", 0)), blocks_in=int(delta.get("blocks_in", 0)),
               copy_s=round(delta.get("kv_offload_copy_seconds", 0.0), 3),
               host_hits_recomputed=int(delta.get("kv_tier_host_hits_recomputed", 0)),
               load_us_per_token=round(after.get("s_per_token_load", 0.0) * 1e6, 3),
               recompute_us_per_token=round(after.get("s_per_token_recompute", 0.0) * 1e6, 3))
    return row


def parse_modes(text: str) -> list[tuple[str, bool]]:
    """``--modes``: (policy, alone) in order; SystemExit (one line) on a bad entry."""
    modes = []
    for entry in (m.strip() for m in text.split(",") if m.strip()):
        name, _, suffix = entry.partition("/")
        name = {"on": "auto"}.get(name, name)
        if name not in MODES or suffix not in ("", "alone"):
            raise SystemExit(f"--modes {entry!r}: a comma-separated list of {', '.join(MODES)}, "
                             f"each optionally /alone")
        modes.append((name, suffix == "alone"))
    if not modes:
        raise SystemExit("--modes: name at least one mode")
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--address", default=None, help="use a running server (one mode) instead of starting one")
    ap.add_argument("--port", type=int, default=50171)
    ap.add_argument("--metrics-port", type=int, default=50173, help="the control plane's /metrics")
    ap.add_argument("--modes", default="off,auto,always",
                    help="in this order: off (no host tier), and a host tier under each "
                         "--kv-offloading-policy named: auto, always, never (on: auto); MODE/alone "
                         "plays the first --alone-conversations one turn at a time")
    ap.add_argument("--fresh-server", action="store_true",
                    help="a whole headrace serve per mode (default: one data plane for all modes)")
    ap.add_argument("--num-kv-blocks", type=int, default=8192,
                    help="the device KV pool (blocks of 16; W5's histories reach ~470k tokens)")
    ap.add_argument("--offload-gib", type=float, default=48.0, help="--kv-offloading-size of the host tier")
    ap.add_argument("--serve-args", default="--max-running 256 --max-batched-tokens 8192",
                    help="more `headrace serve` options (both planes take them)")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32, help="turns in flight at once")
    ap.add_argument("--alone-conversations", type=int, default=8, help="conversations a MODE/alone plays")
    ap.add_argument("--warmup-conversations", type=int, default=4,
                    help="untimed conversations (two turns, other tokens) before each mode")
    ap.add_argument("--system-tokens", type=int, default=200, help="the shared system prompt")
    ap.add_argument("--user-tokens", type=int, default=300, help="new user tokens per turn (mean)")
    ap.add_argument("--output-tokens", type=int, default=150, help="tokens generated per turn")
    ap.add_argument("--vocab", type=int, default=2000, help="token ids are drawn below this")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true",
                    help="serve with --deterministic: every mode must give the same tokens and "
                         "logprobs (docs/determinism.md)")
    args = ap.parse_args()
    if args.model is None:
        from headrace.cli.options import default_model
        args.model = default_model()
    modes = parse_modes(args.modes)
    dataplane, workers, tmp = None, None, tempfile.mkdtemp(prefix="w5-")
    if args.address is None and not args.fresh_server:
        workers = f"unix:{tmp}/dp.sock"
        dataplane = start_dataplane(args, workers)
    rows = []
    try:
        for mode, alone in modes:
            row = run_mode(args, mode, alone, workers)
            base = next((r for r in rows if r["offloading"].endswith("/alone") == alone), None)
            if base is not None:
                row["tokens_vs_first"] = compare(row, base)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
    finally:
        if dataplane is not None:
            stop_server(dataplane)
    table(rows)


if __name__ == "__main__":
    main()
