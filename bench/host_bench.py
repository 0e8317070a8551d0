"""Host-only benchmark of the planes' per-step Python: the control plane's engine (scheduler,
block manager, stop checks, detokenization, request wake-ups) driving the data plane's runner
(step deltas, input preparation, uploads, sampling) with the model replaced by constant logits,
on the CPU, so no device time hides anything. W1's requests; prints the host time per step and
per token and, with --profile, the top functions.

    python -P bench/host_bench.py [--num-seqs 256] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time

import torch

from controlplane.engine import Engine, EngineConfig
from controlplane.tokenizer import ModelTokenizer
from controlplane.validation import build_request
from dataplane.runner import ModelRunner
from headrace.dataplane.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb
from inprocess_bench import LocalWorkers, consume
from serving_bench import w1_requests

VOCAB = 16


class ConstantLogitsRunner(ModelRunner):
    vocab = VOCAB

    def _logits(self, prep, dev):
        return torch.zeros(len(prep.sample_rows), self.vocab) if len(prep.sample_rows) else None


class HostOnlyWorker:
    """What the data plane's server needs of a Worker, with constant logits instead of a model."""

    def __init__(self, max_model_len: int = 4096, num_blocks: int = 200_000, vocab: int = VOCAB):
        caches = [torch.empty(2, num_blocks, 1, 1, 1)]
        self.runner = ConstantLogitsRunner(None, caches, 16, torch.device("cpu"), max_model_len, 256)
        self.runner.vocab = vocab
        self.startup_seconds = 0.0
        self.info = wpb.WorkerInfo(model_name="host-only", vocab_size=vocab, max_model_len=max_model_len,
                                   block_size=16, num_kv_blocks=num_blocks, max_num_seqs=256,
                                   max_batched_tokens=8192)

    def describe(self):
        return self.info


async def run(args) -> dict:
    local = LocalWorkers(HostOnlyWorker())
    engine = Engine(local, EngineConfig(max_running=256, max_batched_tokens=8192))
    await engine.start()
    tok = ModelTokenizer(args.tokenizer)
    requests = w1_requests()[:args.num_seqs]
    reqs = []
    for prompt, max_tokens, temperature in requests:
        req = build_request(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[t % VOCAB for t in prompt]),
                                               max_tokens=max_tokens, ignore_eos=True,
                                               sampling=pb.SamplingParams(temperature=temperature)),
                            tok, seq_ids=engine.seq_ids, vocab_size=VOCAB, max_model_len=engine.max_model_len,
                            eos_token_ids=[])
        reqs.append(req)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for req in reqs:
        engine.submit(req)
    tokens = sum(await asyncio.gather(*(consume(r) for r in reqs)))
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    steps = local.steps_sent
    await engine.stop()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {"workload": "w1-host-only", "output_tokens": tokens, "steps": steps, "wall_s": round(wall, 3),
            "runner_s": round(local.runner_s, 3), "host_ms_per_step": round(wall / steps * 1e3, 3),
            "host_us_per_token": round(wall / tokens * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--tokenizer", default="dataplane/default_model/tiny")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
