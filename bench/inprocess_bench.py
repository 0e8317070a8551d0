"""Benchmark-only path: the control plane's engine (scheduler, block manager, stop checks,
detokenization) drives the data plane's runner in ONE process, with no gRPC between them and
no client streams. Compared with bench/serving_bench.py it shows what the plane split costs.
The bench sits above both planes and composes them (``headrace.dataplane.inprocess``).

    python -m bench.inprocess_bench --model DIR --workload w1|w2|long [--device cuda] [--profile
        FILE] [--speculative-config JSON [--grounded | --text-prompts]] [--attention-backend
        auto|triton|flash-attn]

Prints a JSON line: throughput (w1) or per-token latency (w2), plus the share of wall time spent
inside the runner (`runner_s`) against the engine's own Python work. With ``--speculative-config``
it adds the measured acceptance; ``long`` times the first token of three prompts of
``--prompt-tokens`` random tokens (30,000 by default), one at a time; ``--grounded`` makes W2's
prompts input-grounded (a passage given twice, so n-gram proposals can hit) instead of random;
``--text-prompts`` takes them from held-out text of the embedded model's corpus (a model trained on
it, and its draft, can predict such text).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import hashlib
import pstats
import random
import struct
import time

from bench.serving_bench import w1_requests
from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.requests.validation import build_request
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.kernels.attention_policy import BACKENDS
from headrace.v1 import inference_pb2 as pb


class TimedWorkers(InProcessWorkerGroup):
    """The in-process worker group, timed: host time inside the runner, device time and idle
    of every step, and (on request) a profile or a timeline of the first launches."""

    def __init__(self, worker: Worker):
        super().__init__(worker, launch_hook=self._timed_launch)
        self.runner_s, self.step_ends = 0.0, []
        self.device_s = self.device_idle_s = 0.0
        self.steps_sent, self.windows, self.steps = 0, [], []
        self.launch_ms: dict[int, float] = {}   # step id -> host time of the runner's launch
        self.launch_profile: cProfile.Profile | None = None   # profiles launches while set
        self.launch_profile_steps = 0
        self.timeline: list = []      # (host start, host end, Launched) of the first launches
        self.timeline_steps = 0

    def _timed_launch(self, step, launch):
        t0 = time.perf_counter()
        if self.launch_profile is not None and self.launch_profile_steps > 0:
            self.launch_profile_steps -= 1
            launched = self.launch_profile.runcall(launch)
        else:
            launched = launch()
        t1 = time.perf_counter()
        self.launch_ms[step.step_id] = (t1 - t0) * 1e3
        if len(self.timeline) < self.timeline_steps:
            self.timeline.append((t0, t1, launched))
        return launched

    async def send(self, request):
        self.steps_sent += 1
        for window in self.windows:
            window.at_step(self.steps_sent)
        t0 = time.perf_counter()
        ready = await super().send(request)
        now = time.perf_counter()
        self.runner_s += now - t0
        self.step_ends += [(now, len(r.token_ids)) for r in ready if r.token_ids]
        self.device_s += sum(r.device_ms for r in ready) / 1e3
        self.device_idle_s += sum(r.device_idle_ms for r in ready) / 1e3
        self.steps += [(len(r.seq_ids), r.device_ms, r.device_idle_ms, self.launch_ms.pop(r.step_id, 0.0))
                       for r in ready]
        return ready


class KernelWindow:
    """torch.profiler over steps [first, last) of the timed run: prints the device kernels'
    time per step, by kernel (CUDA activity only: no host-side tracing overhead)."""

    def __init__(self, spec: str, out_dir: str):
        self.first, self.last = (int(x) for x in spec.split(":"))
        self.out_dir, self.prof, self.offset = out_dir, None, 0

    def at_step(self, n: int) -> None:
        import torch
        n -= self.offset
        if n == self.first:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif n == self.last and self.prof is not None:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            steps = self.last - self.first
            rows = sorted(self.prof.key_averages(), key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in rows)
            lines = [f"steps {self.first}:{self.last}: device kernel time {total / steps / 1e3:.3f} ms/step"]
            for e in rows[:22]:
                lines.append(f"{e.device_time_total / steps / 1e3:9.4f} ms/step {e.count // steps:5d}x  {e.key[:110]}")
            text = "\n".join(lines)
            print(text, flush=True)
            with open(f"{self.out_dir}/kernels-{self.first}-{self.last}.txt", "w") as f:
                f.write(text + "\n")
            self.prof = None


class Timeline:
    """Host and device times of the first launches on one clock: a reference CUDA event is
    recorded on an idle device at a known host time, and every step's begin/done events are
    read against it (ms since the reference)."""

    def __init__(self):
        import torch
        torch.cuda.synchronize()
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        torch.cuda.synchronize()
        self.host0 = time.perf_counter()

    def print(self, rows) -> None:
        print("step  host_launch_start  host_launch_end  device_begin  device_end  (ms since start)")
        for i, (t0, t1, launched) in enumerate(rows):
            if launched.begin is None:
                continue
            launched.done.synchronize()
            print(f"{i:4d} {1e3 * (t0 - self.host0):18.1f} {1e3 * (t1 - self.host0):16.1f} "
                  f"{self.ref.elapsed_time(launched.begin):13.1f} {self.ref.elapsed_time(launched.done):11.1f}")


def print_step_table(steps: list[tuple[int, float, float, float]]) -> None:
    """Device time, device idle (the gap before each step) and the host time of the runner's
    launch over ranges of the timed steps (the first twelve, where W1 prefills, one by one)."""
    print("steps      sampled/step  device_ms  idle_ms  idle_ms/step  launch_ms/step")
    edges = list(range(12)) + [20, 50, 100, 300, 600, 900, 1000, len(steps)]   # prefill: each step
    for lo, hi in zip(edges, edges[1:]):
        part = steps[lo:hi]
        if not part:
            continue
        dev, idle = sum(s[1] for s in part), sum(s[2] for s in part)
        print(f"{lo:4d}-{hi:<5d} {sum(s[0] for s in part) / len(part):12.1f} {dev:10.1f} "
              f"{idle:8.1f} {idle / len(part):12.3f} {sum(s[3] for s in part) / len(part):14.3f}")


@functools.cache
def _held_out_paragraphs() -> tuple[str, ...]:
    from headrace.dataplane.default_model import train

    held_out = train.read_chapters(train.HERE / "corpus.txt")[-3:]   # as train.py holds out
    return tuple(p for chapter in held_out for p in chapter if len(p) > 400)


def text_prompt(tok: ModelTokenizer, rng: random.Random, n: int) -> list[int]:
    """``n`` tokens of held-out text (the embedded model's corpus after the chapters it was
    trained on), starting at a random paragraph."""
    return tok.encode(rng.choice(_held_out_paragraphs()))[:n]


def submitter(engine: Engine, tok: ModelTokenizer):
    """``submit(prompt ids, max_tokens, temperature)``: a request (EOS ignored) given to
    ``engine``, returned to be consumed."""
    def submit(prompt, max_tokens, temperature):
        req = build_request(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                               ignore_eos=True, sampling=pb.SamplingParams(temperature=temperature)),
                            tok, seq_ids=engine.seq_ids, vocab_size=engine.info.vocab_size,
                            max_model_len=engine.max_model_len, eos_token_ids=[],
                            deterministic=engine.deterministic)
        engine.submit(req)
        if OUTPUTS is not None:
            SUBMITTED.append(req.request_id)
        return req
    return submit


OUTPUTS: dict | None = None   # (--digest) request id -> its token ids
SUBMITTED: list = []          # (--digest) request ids in submit order


async def consume(request) -> int:
    count, ids = 0, []
    while not request.delivered:
        for m in await request.next_responses():
            count += len(m.token_ids)
            ids.extend(m.token_ids)
    if OUTPUTS is not None:
        OUTPUTS[request.request_id] = ids
    return count


async def run(args) -> dict:
    worker = Worker(WorkerOptions(model=args.model, device=args.device, max_num_seqs=256,
                                  max_batched_tokens=args.max_batched_tokens,
                                  speculative_config=args.speculative_config,
                                  attention_backend=args.attention_backend,
                                  cudagraph_mode=args.cudagraph_mode,
                                  deterministic=args.deterministic))
    local = TimedWorkers(worker)
    engine = Engine(local, EngineConfig(max_running=256, max_batched_tokens=args.max_batched_tokens))
    await engine.start()
    tok = ModelTokenizer(args.model)
    submit = submitter(engine, tok)
    await consume(submit([1, 2, 3], 4, 0.6))     # warm-up
    global OUTPUTS
    OUTPUTS = {} if args.digest else None
    local.runner_s = local.device_s = local.device_idle_s = 0.0
    local.steps = []
    local.windows = [KernelWindow(w, args.out_dir) for w in args.kernel_windows]
    for window in local.windows:
        window.offset = local.steps_sent
    if args.launch_profile_steps:
        local.launch_profile, local.launch_profile_steps = cProfile.Profile(), args.launch_profile_steps
    timeline = None
    if args.timeline_steps:
        timeline, local.timeline_steps = Timeline(), args.timeline_steps
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    prompts = w1_requests()   # drawn before the clock starts, as serving_bench does
    if args.text_prompts:
        _held_out_paragraphs()
    start = time.perf_counter()
    if args.workload == "w1":
        reqs = [submit(*r) for r in prompts]
        tokens = sum(await asyncio.gather(*(consume(r) for r in reqs)))
        wall = time.perf_counter() - start
        out = {"output_tokens": tokens, "wall_s": round(wall, 3), "output_tok_per_s": round(tokens / wall, 1)}
    elif args.workload == "long":   # TTFT of a long prompt (chunked prefill), nothing else running
        rng, ttfts = random.Random(0), []
        for _ in range(3):
            t0 = time.perf_counter()
            await consume(submit([rng.randint(0, 10000) for _ in range(args.prompt_tokens)], 1, 0.0))
            ttfts.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
        out = {"prompt_tokens": args.prompt_tokens, "ttft_s": [round(t, 3) for t in ttfts],
               "ttft_s_min": round(min(ttfts), 3)}
    else:
        rng, itls = random.Random(0), []
        for _ in range(5):   # one sequence: ITL = step to step, per token the step yielded
            local.step_ends = []
            if args.text_prompts:   # real text: what a trained draft model can predict
                prompt = text_prompt(tok, rng, 128)
            else:
                prompt = [rng.randint(0, 10000) for _ in range(64 if args.grounded else 128)]
            await consume(submit(prompt * 2 if args.grounded else prompt, args.w2_tokens, 0.0))
            for (a, _), (b, n) in zip(local.step_ends[1:], local.step_ends[2:]):
                itls += [(b - a) / n] * n
        wall = time.perf_counter() - start
        itls.sort()
        out = {"itl_ms_p50": round(itls[len(itls) // 2] * 1e3, 3),
               "itl_ms_p99": round(itls[int(len(itls) * 0.99)] * 1e3, 3)}
    if args.step_table:
        print_step_table(local.steps)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if timeline is not None:
        timeline.print(local.timeline)
    if local.launch_profile is not None:
        print(f"host profile of the runner's launch over the first {args.launch_profile_steps} steps:")
        pstats.Stats(local.launch_profile).sort_stats("tottime").print_stats(28)
    if args.device == "cuda":   # the caching allocator freeing memory mid-run syncs the device
        import torch
        stats = torch.cuda.memory_stats()
        out.update(alloc_retries=stats["num_alloc_retries"], cuda_mallocs=stats["num_device_alloc"])
    spec = engine.scheduler.speculation
    if spec is not None:   # the measured acceptance (the warm-up's included)
        out.update(spec_draft_tokens=spec.num_draft_tokens, spec_accepted_tokens=spec.num_accepted_tokens,
                   spec_acceptance=round(spec.num_accepted_tokens / max(1, spec.num_draft_tokens), 3),
                   spec_accepted_per_pos=spec.accepted_per_pos, spec_num_drafts=spec.num_drafts)
        graphs = worker.runner.graphs
        if graphs is not None:   # verifies replayed in CUDA graphs (the rest ran eagerly)
            out.update(graph_replays=graphs.num_replays, verify_graph_replays=graphs.num_verify_replays)
    out.update(attention_backend=args.attention_backend, attention=worker.attention.describe(),
               cudagraph_mode=worker.graph_mode, graph_capture_s=round(worker.graphs.capture_seconds, 1),
               graph_mib=round(worker.graphs.measured_bytes / 2**20))
    out.update(workload=f"{args.workload}{'-grounded' if args.grounded else ''}"
                        f"{'-spec' if spec is not None else ''}-in-process", runner_s=round(local.runner_s, 3),
               device_s=round(local.device_s, 3), device_idle_s=round(local.device_idle_s, 3),
               wall_s=round(wall, 3), startup_s=round(worker.startup_seconds, 1),
               deterministic=args.deterministic)
    if OUTPUTS is not None:   # the requests in submit order (W1: all at once; W2: one by one)
        ids = [t for rid in SUBMITTED for t in OUTPUTS.get(rid, []) + [-1]]
        out["output_digest"] = hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()[:24]
    await engine.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=["w1", "w2", "long"], default="w1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", choices=BACKENDS, default="auto",
                    help="the worker's --attention-backend (kernels/attention_policy.py)")
    ap.add_argument("--cudagraph-mode", default="full_and_piecewise",
                    help="the worker's --cudagraph-mode (full_decode_only: decode graphs only)")
    ap.add_argument("--prompt-tokens", type=int, default=30000, help="long: the prompt's length")
    ap.add_argument("--max-batched-tokens", type=int, default=16384,
                    help="tokens per step (nano-vllm's default, as its W1 benchmark runs)")
    ap.add_argument("--profile", default=None, help="write cProfile stats of the timed part here")
    ap.add_argument("--launch-profile-steps", type=int, default=0, metavar="N",
                    help="cProfile the runner's launch of the first N timed steps (host hot spots)")
    ap.add_argument("--timeline-steps", type=int, default=0, metavar="N",
                    help="host launch and device begin/end times of the first N steps, one clock")
    ap.add_argument("--kernel-window", dest="kernel_windows", action="append", default=[],
                    metavar="FIRST:LAST", help="profile device kernels over these steps of the run")
    ap.add_argument("--out-dir", default=".", help="where kernel window tables go")
    ap.add_argument("--speculative-config", default=None, help="the worker's speculative decoding (JSON)")
    ap.add_argument("--grounded", action="store_true",
                    help="w2: each prompt is a random passage given twice (n-gram proposals can hit)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="w2: prompts of held-out text from the embedded model's corpus (for models "
                         "trained on it, e.g. a draft/target pair) instead of random ids")
    ap.add_argument("--w2-tokens", type=int, default=256, help="w2: tokens generated per request")
    ap.add_argument("--step-table", action="store_true",
                    help="print device time and idle over ranges of the timed steps")
    ap.add_argument("--deterministic", action="store_true",
                    help="the worker's --deterministic (batch-invariant kernels; docs/determinism.md)")
    ap.add_argument("--digest", action="store_true",
                    help="output_digest: a hash of every request's tokens (runs compare by it)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
