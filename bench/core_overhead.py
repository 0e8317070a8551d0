"""What the control plane itself costs, on a CPU: the real engine core and API front ends (or
the control plane in one process, ``--layout whole``) over a data plane whose steps cost
nothing (``bench.null_worker``, the real step protocol without a model; ``--dataplane real``:
the CPU data plane), so the control plane's own work dominates. The model directory gives the
tokenizer (default ``qwen3-micro``: 1 layer, hidden 32, vocab 1024).

    python -m bench.core_overhead                      # split: core + 1 front end
    python -m bench.core_overhead --frontends 2 --profile /tmp/prof   # cProfile core, front end 0
    python -m bench.core_overhead --layout whole       # ControlPlane in one process

Measures (i) batch-1 TTFT and ITL through the public gRPC port (``--ttft-repeats`` requests one
after the other; 128-token prompt, 32 new tokens) and where each first token spent its time
(``first_token_ms``: the stages of ``bench.first_token``, from ``headrace.common.stage_times``
stamps the processes write; ``--no-stages`` runs without them, as the earlier figures did; a table
of them goes to stderr), and (ii) many concurrent streaming requests (``--concurrency``, every token
streamed): output tokens/s, the data plane's steps, and the engine core's CPU seconds per step and
per streamed token (from /proc). With ``--profile DIR`` the core and front end 0 run under cProfile
(stats in DIR/core.prof and DIR/frontend.prof) and the JSON line adds the control plane's stages:
each one's calls and cumulative µs per streamed token (cProfile's overhead included: compare runs,
not absolutes). Prints one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from bench.first_token import ClientStamps, decompose, table
from headrace.common.stage_times import ENV as STAGES_ENV
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dataplane_steps(port: int, steps_file: str) -> tuple[float, float]:
    """(steps, device seconds of those steps) so far (the null worker: no device time)."""
    if not port:   # the null worker keeps its count in a file
        text = pathlib.Path(steps_file).read_text().strip()
        return float(text or 0), 0.0
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():   # summed over labels (the step kinds)
        if line and line[0] != "#":
            name, _, value = line.rpartition(" ")
            name = name.partition("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return (values.get("headrace:dataplane_steps_total", 0.0),
            values.get("headrace:dataplane_step_device_seconds_sum", 0.0))


def run_whole(argv: list[str]) -> None:
    """``--role whole``: the control plane in one process (``ControlPlane``) until SIGTERM."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model"), ap.add_argument("--workers"), ap.add_argument("--port", type=int)
    ap.add_argument("--max-running", type=int), ap.add_argument("--pipeline-depth", type=int)
    a = ap.parse_args(argv)
    from headrace.controlplane.engine.loop import EngineConfig
    from headrace.controlplane.server import ControlPlane, run_until_signal
    config = EngineConfig(max_running=a.max_running, max_batched_tokens=16384,
                          pipeline_depth=a.pipeline_depth)

    async def run():
        await run_until_signal(ControlPlane(a.model, [a.workers], f"127.0.0.1:{a.port}", config,
                                            log_requests=False))

    asyncio.run(run())


class Planes:
    """The data plane, then the control plane (split or whole), as child processes."""

    def __init__(self, args, tmp: str):
        py, env = sys.executable, dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
        self.stages = None if args.no_stages else os.path.join(tmp, "stages")
        if self.stages:   # every process stamps the first-token path (bench.first_token)
            env[STAGES_ENV] = self.stages
        self.port, self.dp_metrics = free_port(), free_port()
        dp, core = f"unix:{tmp}/dp.sock", f"unix:{tmp}/core.sock"
        self.procs: list[subprocess.Popen] = []
        log = open(os.path.join(tmp, "planes.log"), "w")

        def start(cmd):
            self.procs.append(subprocess.Popen([py] + cmd, env=env, stdout=log, stderr=log))
            return self.procs[-1]

        self.steps_file = os.path.join(tmp, "steps")
        pathlib.Path(self.steps_file).write_text("0")
        kv = ["--listen", dp, "--num-kv-blocks", "8192", "--block-size", "16",
              "--max-num-seqs", str(args.concurrency)]
        if args.dataplane == "null":
            self.dp_metrics = 0
            start(["-m", "bench.null_worker", *kv, "--steps-file", self.steps_file,
                   "--step-ms", str(args.step_ms)])
        else:
            start(["-m", "headrace.cli", "dataplane", "--model", args.model, "--device", args.device, *kv,
                   "--metrics-port", str(self.dp_metrics)])
        common = ["--model", args.model, "--max-num-seqs", str(args.concurrency),
                  "--pipeline-depth", str(args.pipeline_depth)]
        prof = ["-m", "cProfile", "-o", f"{args.profile}/core.prof"] if args.profile else []
        if args.layout == "whole":
            self.core = start(prof + ["-m", "bench.core_overhead", "--role", "whole", "--model", args.model,
                                      "--workers", dp, "--port", str(self.port), "--max-running",
                                      str(args.concurrency), "--pipeline-depth", str(args.pipeline_depth)])
            return
        self.core = start(prof + ["-m", "headrace.cli", "core", *common, "--workers", dp, "--core-address", core,
                                  "--max-batched-tokens", "16384", "--disable-log-requests",
                                  "--metrics-port", "0"])
        for i in range(args.frontends):
            fprof = ["-m", "cProfile", "-o", f"{args.profile}/frontend.prof"] if args.profile and i == 0 else []
            start(fprof + ["-m", "headrace.cli", "frontend", "--index", str(i), "--core-address", core, "--model", args.model,
                   "--port", str(self.port), "--host", "127.0.0.1", "--metrics-port", "0"])

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each process (the data plane, the core, the front ends), and
        of this one (the clients)."""
        names = ["dataplane", "core"] + [f"frontend{i}" for i in range(len(self.procs) - 2)]
        return dict(zip(names, map(cpu_seconds, (p.pid for p in self.procs))), client=time.process_time())

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


async def wait_serving(stub, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
            async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]),
                                                            max_tokens=2)):
                pass
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def one(stub, prompt: list[int], max_tokens: int, request_id: str = "",
              stamps: ClientStamps | None = None) -> tuple[float, list[float], int]:
    """(TTFT, inter-message gaps, tokens) of one streamed request (``stamps``: its client-side
    stage stamps, under ``request_id``)."""
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0),
                             request_id=request_id)
    if stamps is not None:
        stamps.sent(request_id)
    start = last = time.perf_counter()
    ttft, gaps, n = None, [], 0
    async for resp in stub.Generate(req):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
            if stamps is not None:
                stamps.first(request_id)
        else:
            gaps.append(now - last)
        last, n = now, n + len(resp.token_ids)
    return ttft, gaps, n


def ms(x: float) -> float:
    return round(x * 1000, 3)


async def measure(args, planes: Planes) -> dict:
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{planes.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        await wait_serving(stub)
        ttfts, gaps, ids = [], [], []
        stamps = ClientStamps(planes.stages) if planes.stages else None
        for i in range(args.ttft_repeats + 2):   # two warm-ups
            if i == 2:
                steps0 = dataplane_steps(planes.dp_metrics, planes.steps_file)
            rid = f"ttft-{i}"
            t, g, _ = await one(stub, [rng.randrange(3, 1000) for _ in range(128)], 32, rid, stamps)
            if i >= 2:
                ttfts.append(t)
                gaps += g
                ids.append(rid)
        steps, device = (b - a for a, b in zip(steps0, dataplane_steps(planes.dp_metrics, planes.steps_file)))
        out = {"ttft_p50_ms": ms(statistics.median(ttfts)), "ttft_min_ms": ms(min(ttfts)),
               "itl_p50_ms": ms(statistics.median(gaps)), "b1_steps_per_request": steps / args.ttft_repeats,
               "b1_device_ms_per_step": ms(device / max(steps, 1))}
        if planes.stages:
            out["first_token_ms"] = decompose(planes.stages, ids)
            print(table(out["first_token_ms"]), file=sys.stderr)
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(100, 300))]
                   for _ in range(args.concurrency)]
        steps0, cpu0 = dataplane_steps(planes.dp_metrics, planes.steps_file)[0], planes.cpu()
        start = time.perf_counter()
        results = await asyncio.gather(*(one(stub, p, args.output_tokens) for p in prompts))
        wall = time.perf_counter() - start
        steps = dataplane_steps(planes.dp_metrics, planes.steps_file)[0] - steps0
        cpus = {k: round(v - cpu0[k], 2) for k, v in planes.cpu().items()}
    cpu, tokens = cpus["core"], sum(r[2] for r in results)
    out.update(load_requests=len(results), load_tokens=tokens, load_wall_s=round(wall, 2),
               tok_per_s=round(tokens / wall), steps=int(steps),
               cpu_s=cpus, core_cpu_ms_per_step=round(1000 * cpu / max(steps, 1), 3),
               core_cpu_us_per_token=round(1e6 * cpu / max(tokens, 1), 2),
               load_ttft_p50_ms=ms(statistics.median(r[0] for r in results)))
    return out


STAGES = {   # (process, file, function): the control plane's stages a token goes through
    "core": [("engine.py", "_loop"), ("scheduler.py", "schedule"), ("inflight.py", "send"),
             ("engine.py", "_fold"), ("core/service.py", "flush"), ("core/service.py", "next_message"),
             ("core/service.py", "_read")],
    "frontend": [("frontend/client.py", "_apply"), ("controlplane/service.py", "Generate"),
                 ("request.py", "take_response")],
}


def stages(directory: str, tokens: int) -> dict:
    """Calls and cumulative µs per token of each stage in STAGES, from the cProfile stats."""
    import pstats
    out = {}
    for proc, wanted in STAGES.items():
        stats = pstats.Stats(f"{directory}/{proc}.prof").stats
        for (path, _, name), (_, ncalls, _, cum, _) in stats.items():
            for suffix, func in wanted:
                if name == func and path.endswith(suffix):
                    out[f"{proc}:{suffix.split('/')[-1][:-3]}.{func}"] = [ncalls, round(1e6 * cum / tokens, 2)]
    return out


def main() -> None:
    if sys.argv[1:3] == ["--role", "whole"]:
        return run_whole(sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: qwen3-micro, written to a temp dir)")
    ap.add_argument("--dataplane", choices=["null", "real"], default="null",
                    help="null: bench.null_worker (steps cost nothing); real: the CPU data plane")
    ap.add_argument("--device", default="cpu", help="--dataplane real: its device")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the null worker's time per step")
    ap.add_argument("--layout", choices=["split", "whole"], default="split")
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--pipeline-depth", type=int, default=3)
    ap.add_argument("--ttft-repeats", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--profile", default=None, help="a directory: cProfile the core and front end 0")
    ap.add_argument("--label", default="", help="a name for this run in its JSON line (bench.gpu_table)")
    ap.add_argument("--no-stages", action="store_true",
                    help="no first-token stage stamps (headrace.common.stage_times) in the processes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="headrace-overhead-") as tmp:
        if args.model is None:
            from bench.random_checkpoint import write_checkpoint
            args.model = str(write_checkpoint("qwen3-micro", pathlib.Path(tmp) / "model"))
        planes = Planes(args, tmp)
        try:
            result = asyncio.run(measure(args, planes))
        finally:
            planes.stop()
    result.update(dataplane=args.dataplane, layout=args.layout, frontends=args.frontends,
                  pipeline_depth=args.pipeline_depth, workload="core_overhead", label=args.label)
    if args.profile:
        result["stages_us_per_token"] = stages(args.profile, result["load_tokens"] + 32 * args.ttft_repeats)
    print(json.dumps(result))

if __name__ == "__main__":
    main()
