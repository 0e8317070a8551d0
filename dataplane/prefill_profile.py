"""Times prefills of several sizes once at start (``WorkerInfo.prefill_profile_tokens`` /
``_seconds``): the control plane's host KV tier prices recomputing a host-tier hit by their slope
against loading it (``headrace.controlplane.kv.tier_cost``), so the price is this device's, at the
step sizes the scheduler emits, and not guessed from step times that mix decodes in.

Each size runs as a real step through the runner (one new sequence from position 0, greedy,
flushed), so it costs what the engine's prefill of that many tokens costs: the same
attention backend choice, projections and sampling. Its KV goes to the first blocks of the
cache, which hold nothing yet; the runner forgets the sequence after each run.
"""

from __future__ import annotations

import logging

import torch

from headrace.dataplane.runner import ModelRunner
from headrace.worker.v1 import worker_pb2 as pb

log = logging.getLogger("headrace.dataplane")
CPU_LARGEST = 128   # a CPU prefills slowly: the profile stays small there
_SEQ_ID = 1 << 62   # far from the control plane's ids (it starts from a fresh mirror anyway)


def sizes(max_batched_tokens: int, max_model_len: int, num_blocks: int, block_size: int,
          device: torch.device) -> list[int]:
    """The prefill sizes timed: the step budget and its half, quarter and eighth, each fitting
    the model and the KV pool (on a CPU at most ``CPU_LARGEST`` tokens, and its quarter)."""
    largest = min(max_batched_tokens, max_model_len - 1, num_blocks * block_size)
    if device.type != "cuda":
        largest = min(largest, CPU_LARGEST)
        return sorted({n for n in (largest, largest // 4) if n >= 1})
    return sorted({n for n in (largest, largest // 2, largest // 4, largest // 8) if n >= 1})


@torch.inference_mode()
def measure(runner: ModelRunner, token_counts: list[int], vocab_size: int, repeats: int = 3) -> list[float]:
    """Seconds each prefill of ``token_counts`` takes: the best of ``repeats`` runs (one on a
    CPU), after one untimed run of the smallest (device time between the step's first and last
    op on a GPU, host time from launch to result on a CPU: a loaded machine's noise only adds,
    the minimum filters it)."""
    if runner.device.type != "cuda":
        repeats = 1
    seconds, seq_id = [], _SEQ_ID
    for n in token_counts[:1] + token_counts:
        blocks = list(range(-(-n // runner.block_size)))
        prompt = [(7 * i + 1) % vocab_size for i in range(n)]
        best = float("inf")
        for _ in range(repeats):
            seq_id += 1
            step = pb.StepRequest(step_id=seq_id, flush=True)
            step.new_seqs.add(seq_id=seq_id, prompt_token_ids=prompt, block_ids=blocks,
                              num_scheduled_tokens=n, sampling=pb.Sampling(top_p=1.0, repetition_penalty=1.0))
            result = runner.finish(runner.launch(step))
            runner.reset()
            best = min(best, (result.device_ms or result.execute_ms) / 1e3)
        seconds.append(best)
    seconds = seconds[1:]   # the warm-up's
    log.info("prefill profile: %s", ", ".join(f"{n} tokens {s * 1e3:.2f} ms" for n, s in zip(token_counts, seconds)))
    return seconds
