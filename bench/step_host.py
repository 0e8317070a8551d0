"""The data plane's own time per step, by step kind: drives ``ModelRunner`` directly with synthetic
StepRequests (a small control plane of its own: block tables, chunked prompts, sequences that
finish) and reports, per step kind and CUDA-graph mode, the host time of each phase of ``launch``
(apply the delta, build and pack the inputs, queue their upload and launch the forward, launch
sampling) and of ``finish`` (after the device is done: read back, build the result), next to the
device time (on a GPU).

    python -m bench.step_host --model DIR [--device cuda] [--seqs 256] [--prefill 512]
        [--modes full_decode_only,full_and_piecewise] [--steps 20]

Step kinds: ``decode`` (``--seqs`` decodes), ``mixed`` (the decodes and one new prompt of
``--prefill`` tokens, prefilled whole; it finishes the next step), ``prefill`` (``--prefill-
only`` tokens of new prompts). Each is timed twice: serially (each step finished before the
next is launched: ``execute_ms`` against ``device_ms``, and host time outside the device,
``execute - device``) and pipelined as the worker serves (step N+1 launched before step N is
finished: wall time and device idle per step). Modes are ``--cudagraph-mode`` values, switched
on one worker (its graphs are captured once; ``full``'s step graphs are captured beside the
worker's own, into the same memory pool, when asked for). On a CPU every forward runs eagerly and
``forward`` is the model itself: the other phases are the host's real cost. Prints a table
and one JSON line per (mode, kind).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.worker.v1 import worker_pb2 as pb

PHASES = ("apply", "build", "forward", "sample", "finish")


class SyntheticPlane:
    """Just enough of a control plane: sequence ids, block tables and computed counts."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.bs, self.rng = block_size, np.random.default_rng(seed)
        self.next_id, self.step_id = 1, 0
        self.seqs: dict[int, list] = {}   # seq id -> [tokens known, blocks]
        self.finish_next: list[int] = []

    def _blocks(self, n_tokens: int, have: int) -> list[int]:
        need = -(-n_tokens // self.bs) - have
        return [self.free.pop() for _ in range(max(0, need))]

    def step(self, decodes: list[int], prompts: list[int], finish_after: bool = False) -> pb.StepRequest:
        """Decodes of ``decodes`` (seq ids) and new sequences with prompts of these lengths."""
        self.step_id += 1
        step = pb.StepRequest(step_id=self.step_id, finished_seq_ids=self.finish_next)
        for sid in self.finish_next:
            self.free.extend(self.seqs.pop(sid)[1])
        self.finish_next = []
        for sid in decodes:
            known, blocks = self.seqs[sid]
            new = self._blocks(known + 1, len(blocks))
            blocks.extend(new)
            self.seqs[sid][0] = known + 1
            step.running_seq_ids.append(sid)
            step.running_num_scheduled.append(1)
            step.running_new_block_counts.append(len(new))
            step.running_new_block_ids.extend(new)
        for n in prompts:
            sid, self.next_id = self.next_id, self.next_id + 1
            blocks = self._blocks(n + 1, 0)
            self.seqs[sid] = [n, blocks]
            step.new_seqs.add(seq_id=sid, prompt_token_ids=self.rng.integers(2, 1000, n).tolist(),
                              block_ids=blocks, num_computed_tokens=0, num_scheduled_tokens=n,
                              sampling=pb.Sampling(temperature=0.0, top_p=1.0, repetition_penalty=1.0))
            if finish_after:
                self.finish_next.append(sid)
        return step


def stub_forward(model) -> None:
    """The model's forward returns zeros at once (``--stub-model``): what remains of a step is
    the data plane's own host work (and the LM head and sampling over the sampled rows)."""
    import torch

    hidden = model.cfg.hidden_size
    dtype = model.model.embed_tokens.weight.dtype
    model.forward = lambda ids, *_: torch.zeros((len(ids), hidden), dtype=dtype, device=ids.device)


def run_kind(runner, plane: SyntheticPlane, kind: str, decodes: list[int], args) -> dict:
    """Times ``args.steps`` steps of ``kind`` serially, then as many pipelined."""
    def make():
        if kind == "decode":
            return plane.step(decodes, [])
        if kind == "mixed":
            return plane.step(decodes, [args.prefill], finish_after=True)
        return plane.step([], [args.prefill_only // 4] * 4, finish_after=True)

    serial = []
    for i in range(args.warmup + args.steps):
        launched = runner.launch(make())
        result = runner.finish(launched)
        if i >= args.warmup:   # (an older runner, the regression hunt's baseline, has no phases)
            serial.append((dict(getattr(launched, "host_ms", {})), result.execute_ms,
                           result.device_ms, getattr(launched, "graph", "")))
    pending, device, idle = None, 0.0, 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        launched = runner.launch(make())
        if pending is not None:
            r = runner.finish(pending)
            device, idle = device + r.device_ms, idle + r.device_idle_ms
        pending = launched
    r = runner.finish(pending)
    wall = (time.perf_counter() - t0) * 1e3 / args.steps
    device, idle = (device + r.device_ms) / args.steps, (idle + r.device_idle_ms) / args.steps
    med = statistics.median
    host = {p: round(med([s[0].get(p, 0.0) for s in serial]), 3) for p in PHASES}
    execute, dev = med([s[1] for s in serial]), med([s[2] for s in serial])
    return dict(kind=kind, graph=serial[-1][3], seqs=len(decodes), host_ms=host,
                host_launch_ms=round(sum(v for k, v in host.items() if k != "finish"), 3),
                execute_ms=round(execute, 3), device_ms=round(dev, 3),
                outside_device_ms=round(execute - dev, 3) if dev else None,
                execute_over_device=round(execute / dev, 2) if dev else None,
                pipelined_wall_ms=round(wall, 3), pipelined_device_ms=round(device, 3),
                pipelined_idle_ms=round(idle, 3))


def add_full_graphs(worker) -> dict:
    """Captures ``--cudagraph-mode full``'s step graphs beside the worker's (its decode graphs'
    logits and memory pool shared) as ``worker.graphs.full``; their count, time and memory."""
    import torch

    from headrace.dataplane.full_graphs import FullGraphs

    graphs, runner = worker.graphs, worker.runner
    cuda = runner.device.type == "cuda"
    free = torch.cuda.mem_get_info(runner.device)[0] if cuda else 0
    full = FullGraphs(runner.model, runner.kv_caches, graphs.mixed.max_tokens, graphs.decode.max_batch,
                      graphs.decode.max_batch, runner.batch.max_blocks, runner.device,
                      logits=graphs.decode.logits)
    full.capture(pool=graphs.decode.pool if cuda else None)
    if cuda:
        torch.cuda.synchronize(runner.device)
    graphs.full = full
    return dict(full_graphs=full.num_graphs, full_capture_s=round(full.capture_seconds, 2),
                full_mib=round((free - torch.cuda.mem_get_info(runner.device)[0]) / 2**20) if cuda else 0)


def set_mode(worker, mode: str) -> None:
    """Switches the runner between the worker's captured graphs (``--cudagraph-mode`` values)."""
    graphs, runner = worker.graphs, worker.runner
    runner.graphs = graphs.decode if mode in ("full_and_piecewise", "full_decode_only", "full") else None
    runner.mixed = (graphs.mixed if mode in ("full_and_piecewise", "piecewise")
                    else getattr(graphs, "full", None) if mode == "full" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs", type=int, default=256, help="decodes per decode and mixed step")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of the decoding sequences")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens of a mixed step")
    ap.add_argument("--prefill-only", type=int, default=2048, help="tokens of a prefill step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kinds", default="decode,mixed,prefill")
    ap.add_argument("--modes", default="full_and_piecewise",
                    help="--cudagraph-mode values to time, comma-separated (a GPU captures once)")
    ap.add_argument("--stub-model", action="store_true",
                    help="eager forwards return zeros at once: host work only (CPU comparisons)")
    args = ap.parse_args()
    if args.model is None:
        from headrace.dataplane.default_model import default_model_dir
        args.model = str(default_model_dir())
    tokens = max(2048, args.seqs + args.prefill, args.prefill_only)
    per_seq = -(-(args.context + 4 * (args.warmup + 2 * args.steps) + 16) // 16)
    blocks = (args.seqs + 8) * per_seq + 2 * -(-tokens // 16) + 64
    opts = dict(model=args.model, device=args.device, max_num_seqs=args.seqs + 8,
                max_batched_tokens=tokens, num_kv_blocks=blocks, max_model_len=4096)
    try:
        worker = Worker(WorkerOptions(**opts, cudagraph_mode="full_and_piecewise"))
    except TypeError:   # an older worker (the regression hunt's baseline)
        worker = Worker(WorkerOptions(**opts))
    runner, rows = worker.runner, []
    if hasattr(worker, "graphs") and hasattr(worker.graphs, "describe"):
        g = worker.graphs
        print(json.dumps(dict(graphs=g.describe(), graph_count=g.num_graphs, graph_mib=round(g.measured_bytes / 2**20),
                              graph_estimated_mib=round(g.estimated_bytes / 2**20),
                              graph_capture_s=round(g.capture_seconds, 2))), flush=True)
    if "full" in args.modes.split(",") and getattr(worker.graphs, "mixed", None) is not None:
        print(json.dumps(add_full_graphs(worker)), flush=True)
    if args.stub_model:
        stub_forward(runner.model)
    for mode in args.modes.split(","):
        if hasattr(worker, "graphs") and hasattr(worker.graphs, "decode"):
            set_mode(worker, mode)
        runner.reset()
        plane = SyntheticPlane(runner.num_blocks, 16)
        ids = []   # the decoding sequences: prefilled in steps of up to max_batched_tokens
        while len(ids) < args.seqs:
            n = min(args.seqs - len(ids), max(1, tokens // args.context))
            runner.finish(runner.launch(plane.step(ids, [args.context] * n)))
            ids = list(plane.seqs)
        for kind in args.kinds.split(","):
            row = dict(run_kind(runner, plane, kind, ids, args), mode=mode, device=args.device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'mode':<19}{'kind':<8}{'graph':<10}" + "".join(f"{p:>9}" for p in PHASES)
          + f"{'execute':>9}{'device':>8}{'exe/dev':>8}{'pipe_wall':>10}{'pipe_dev':>9}{'idle':>7}  (ms/step)")
    for r in rows:
        print(f"{r['mode']:<19}{r['kind']:<8}{r['graph']:<10}"
              + "".join(f"{r['host_ms'][p]:9.3f}" for p in PHASES)
              + f"{r['execute_ms']:9.3f}{r['device_ms']:8.3f}{r['execute_over_device'] or 0:8.2f}"
              + f"{r['pipelined_wall_ms']:10.3f}{r['pipelined_device_ms']:9.3f}{r['pipelined_idle_ms']:7.3f}")


if __name__ == "__main__":
    main()
