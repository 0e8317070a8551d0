"""A data plane whose steps cost nothing (for ``bench.core_overhead``): it speaks the real step
protocol (``headrace.worker.v1.Worker``: Describe and the Execute stream) but computes no model.
Each sequence samples a token once every token it knows is computed, as a real worker does; the
token is a function of the sequence and its length (never EOS below 3), and every step is answered
at once (after ``--step-ms``, sleeping: a device's time without a CPU). It counts steps in a file
the benchmark reads.

    python -m bench.null_worker --listen unix:/tmp/dp.sock --steps-file /tmp/steps
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from concurrent import futures

import grpc

from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc

VOCAB = 1024


class NullWorker(wpb_grpc.WorkerServicer):
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, steps_file: str | None,
                 step_ms: float = 0.0):
        self.info = wpb.WorkerInfo(
            model_name="null", architecture="Qwen3ForCausalLM", vocab_size=VOCAB,
            max_model_len=4096, dtype="float32", device="cpu", world_size=1,
            block_size=block_size, num_kv_blocks=num_blocks, kv_bytes_per_block=1,
            eos_token_ids=[2], max_num_seqs=max_num_seqs, max_batched_tokens=16384)
        self.steps, self.step_s = 0, step_ms / 1000
        self._fd = os.open(steps_file, os.O_WRONLY | os.O_CREAT, 0o644) if steps_file else None

    def Describe(self, request, context):
        return self.info

    def Execute(self, request_iterator, context):
        known: dict[int, int] = {}      # seq id -> tokens it knows
        computed: dict[int, int] = {}   # seq id -> tokens whose KV is computed

        def compute(seq_id: int, n: int, result: wpb.StepResult) -> None:
            computed[seq_id] += n
            if computed[seq_id] >= known[seq_id]:
                k = known[seq_id]
                result.seq_ids.append(seq_id)
                result.token_ids.append(3 + (seq_id * 31 + k * 7) % (VOCAB - 3))
                known[seq_id] = k + 1

        for step in request_iterator:
            for seq_id in step.finished_seq_ids:
                known.pop(seq_id, None)
                computed.pop(seq_id, None)
            result = wpb.StepResult(step_id=step.step_id)
            for new in step.new_seqs:
                known[new.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
                computed[new.seq_id] = new.num_computed_tokens
                compute(new.seq_id, new.num_scheduled_tokens, result)
            for seq_id, n in zip(step.running_seq_ids, step.running_num_scheduled):
                compute(seq_id, n, result)
            if step.new_seqs or step.running_seq_ids:
                if self.step_s:   # a device's step time, without using a CPU
                    time.sleep(self.step_s)
                self.steps += 1
                if self._fd is not None:
                    os.pwrite(self._fd, b"%12d\n" % self.steps, 0)
            yield result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port or unix:PATH")
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=0.0, help="each step takes this long (sleeping)")
    ap.add_argument("--steps-file", default=None, help="where the count of steps is kept")
    args = ap.parse_args()
    serve(NullWorker(args.num_kv_blocks, args.block_size, args.max_num_seqs, args.steps_file,
                     args.step_ms), args.listen)


def serve(servicer: wpb_grpc.WorkerServicer, listen: str, options: list | None = None) -> None:
    """Serves ``servicer``'s step protocol on ``listen`` until SIGINT or SIGTERM."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    wpb_grpc.add_WorkerServicer_to_server(servicer, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"cannot bind {listen}")
    server.start()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(0)

if __name__ == "__main__":
    main()
