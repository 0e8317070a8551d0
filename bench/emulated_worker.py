"""A data plane that emulates a GPU's timing without one (for ``bench.structured_bench`` and
``bench.core_overhead`` on a CPU): it speaks the real step protocol through the worker's own
``StepPipeline`` (a step is launched before the one before it is answered; a step sent with
``bitmask_follows`` is sampled when its ``late_bitmask`` comes), over a runner whose device is
a timeline: each forward pass takes ``--forward-ms`` (plus ``--forward-ms-per-seq`` a
sequence) and each sampling ``--sample-ms``, one after the other, while the host only waits
(``finish`` sleeps until the step's sampling has ended). Host CPU is spent as a real worker's
is, busy: ``--prepare-ms`` per step for its host half (the delta, the inputs; done ahead when
the step comes while the one before waits for its bitmasks, ``ModelRunner.prepare_ahead``),
``--launch-ms`` per launch (the upload and graph launch) and ``--sample-host-ms`` per sampling
(its launches). The H200's figures at batch 1 (``bench.step_host``, Qwen3-0.6B): 0.31 / 0.14 /
0.21 ms. Tokens are chosen, without
a model, among those each step's bitmask allows (structured outputs), else as a function of
the sequence and its length; no token is a stop.

What it answers: how much of a constrained step's latency is the control plane's round trip
(its token to the engine, the next bitmasks back) when the device time is what a GPU's is.

    python -m bench.emulated_worker --listen unix:/tmp/ew.sock --vocab-size 151936 --forward-ms 1.2
    python -m headrace.cli controlplane --workers unix:/tmp/ew.sock --model /tmp/micro-bl --port
    50300 ...
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.null_worker import serve
from headrace.dataplane import bitmasks
from headrace.dataplane.pipeline import StepPipeline
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc


class Launched:
    """A step on the emulated device: when its forward pass and its sampling end."""

    def __init__(self, step_id: int, forward_end: float):
        self.step_id, self.forward_end, self.sample_end = step_id, forward_end, forward_end
        self.seq_ids: list[int] = []
        self.positions: list[int] = []   # each sampling sequence's length with its new token
        self.tokens: list[int] = []
        self.out = None        # set once sampled (StepPipeline: None = nothing sampled)
        self.verified = None   # (no speculation)
        self.awaiting = None   # launched with bitmask_follows: sampled by sample_late

    def forward_done(self) -> bool:
        return time.monotonic() >= self.forward_end


class EmulatedRunner:
    """What ``StepPipeline`` calls on a ``ModelRunner``, over a device timeline."""

    def __init__(self, vocab: int, forward_ms: float, per_seq_ms: float, sample_ms: float, launch_ms: float,
                 prepare_ms: float = 0.0, sample_host_ms: float = 0.0):
        self.vocab, self.forward_s, self.per_seq_s = vocab, forward_ms / 1e3, per_seq_ms / 1e3
        self.sample_s, self.launch_s = sample_ms / 1e3, launch_ms / 1e3
        self.prepare_s, self.sample_host_s = prepare_ms / 1e3, sample_host_ms / 1e3
        self.device_free = 0.0
        self.known: dict[int, int] = {}      # seq id -> tokens it knows (a sampled one counted at launch)
        self.computed: dict[int, int] = {}   # seq id -> tokens whose KV is computed
        self._ahead = None                   # (step, its sampling sequences): prepared ahead

    def _run(self, seconds: float) -> float:
        """Queues ``seconds`` of device work; returns when it ends."""
        self.device_free = max(time.monotonic(), self.device_free) + seconds
        return self.device_free

    def needs_history(self, step: wpb.StepRequest) -> bool:
        return False

    def prepare_ahead(self, step: wpb.StepRequest) -> None:
        self._ahead = (step, self._prepare(step))

    def _prepare(self, step: wpb.StepRequest) -> list[int]:
        """The host half: the step's sequences as the worker's mirror takes them; the ones that
        sample, each counting its token (its value comes with the sampling)."""
        _busy(self.prepare_s)
        for seq_id in step.finished_seq_ids:
            self.known.pop(seq_id, None)
            self.computed.pop(seq_id, None)
        sampling = []
        for new in step.new_seqs:
            self.known[new.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.seq_id] = new.num_computed_tokens
            sampling += self._compute(new.seq_id, new.num_scheduled_tokens)
        for seq_id, n in zip(step.running_seq_ids, step.running_num_scheduled):
            sampling += self._compute(seq_id, n)
        for seq_id in sampling:
            self.known[seq_id] += 1
        return sampling

    def launch(self, step: wpb.StepRequest) -> Launched:
        ahead, self._ahead = self._ahead, None
        sampling = ahead[1] if ahead is not None and ahead[0] is step else self._prepare(step)
        _busy(self.launch_s)
        work = bool(step.new_seqs or step.running_seq_ids)
        launched = Launched(step.step_id, self._run(self.forward_s + self.per_seq_s * len(sampling)) if work
                            else time.monotonic())
        launched.seq_ids = sampling
        launched.positions = [self.known[s] for s in sampling]
        if not sampling:
            launched.awaiting = () if step.bitmask_follows else None
            return launched
        if step.bitmask_follows:
            launched.awaiting = True
            return launched
        return self._sample(launched, step.bitmask if step.HasField("bitmask") else None)

    def sample_late(self, launched: Launched, step: wpb.StepRequest) -> Launched:
        awaiting, launched.awaiting = launched.awaiting, None
        return self._sample(launched, step.bitmask) if awaiting else launched

    def finish(self, launched: Launched) -> wpb.StepResult:
        wait = launched.sample_end - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        result = wpb.StepResult(step_id=launched.step_id)
        if launched.out is not None:
            result.seq_ids.extend(launched.seq_ids)
            result.token_ids.extend(launched.tokens)
        return result

    def _compute(self, seq_id: int, n: int) -> list[int]:
        self.computed[seq_id] += n
        return [seq_id] if self.computed[seq_id] >= self.known[seq_id] else []

    def _sample(self, launched: Launched, bitmask: wpb.TokenBitmask | None) -> Launched:
        _busy(self.sample_host_s)
        rows = {}
        if bitmask is not None and bitmask.seq_ids:
            table = bitmasks.rows_of(bitmask, self.vocab)
            rows = {int(s): table[i] for i, s in enumerate(bitmask.seq_ids)}
        for seq_id, k in zip(launched.seq_ids, launched.positions):
            h = seq_id * 31 + k * 7
            row = rows.get(seq_id)
            launched.tokens.append(3 + h % (self.vocab - 3) if row is None else _allowed_token(row, h))
        launched.sample_end, launched.out = self._run(self.sample_s), True
        return launched


def _busy(seconds: float) -> None:
    """Spends ``seconds`` of host CPU (a real worker's Python is busy, not asleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _allowed_token(row: np.ndarray, h: int) -> int:
    """One of the tokens a packed row allows, picked by ``h`` (a word, then a bit in it: no
    unpacking of the whole row, which a device would not do on the host either)."""
    words = np.flatnonzero(row)
    if not len(words):
        return 0
    w = int(words[h % len(words)])
    bits = [b for b in range(32) if (int(row[w]) >> b) & 1]
    return w * 32 + bits[(h // 7) % len(bits)]


class EmulatedWorker(wpb_grpc.WorkerServicer):
    def __init__(self, args):
        self.args = args
        self.info = wpb.WorkerInfo(
            model_name="emulated", architecture="Qwen3ForCausalLM", vocab_size=args.vocab_size,
            max_model_len=4096, dtype="bfloat16", device="emulated", world_size=1,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_bytes_per_block=1,
            eos_token_ids=[args.eos], max_num_seqs=args.max_num_seqs, max_batched_tokens=16384)

    def Describe(self, request, context):
        return self.info

    def Execute(self, request_iterator, context):
        a = self.args
        pipeline = StepPipeline(EmulatedRunner(a.vocab_size, a.forward_ms, a.forward_ms_per_seq,
                                               a.sample_ms, a.launch_ms, a.prepare_ms, a.sample_host_ms))
        for step in request_iterator:
            yield from pipeline.submit(step)
            while pipeline.deferred is not None:   # launched once the answer before it is out
                yield from pipeline.resume()
        yield from pipeline.drain()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port or unix:PATH")
    ap.add_argument("--vocab-size", type=int, default=1024, help="the tokenizer's (the model directory's)")
    ap.add_argument("--eos", type=int, default=2)
    ap.add_argument("--forward-ms", type=float, default=1.2, help="a forward pass (Qwen3-0.6B at batch 1 on an H200)")
    ap.add_argument("--forward-ms-per-seq", type=float, default=0.0, help="added per sampling sequence")
    ap.add_argument("--sample-ms", type=float, default=0.05, help="a sampling (with its bitmask)")
    ap.add_argument("--launch-ms", type=float, default=0.0, help="busy host time per launch (its device work)")
    ap.add_argument("--prepare-ms", type=float, default=0.0, help="busy host time per step's host half")
    ap.add_argument("--sample-host-ms", type=float, default=0.0, help="busy host time per sampling")
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()
    serve(EmulatedWorker(args), args.listen, options=[
        ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])

if __name__ == "__main__":
    main()
