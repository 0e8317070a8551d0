"""What a step's structured-output bitmasks cost on the wire between the planes: the round trip of
one StepRequest over an Execute-shaped gRPC stream (an asyncio client, as the control plane; a sync
server answering each message, as a worker) carrying the same bitmask rows in the plain form (one
packed row each) and in the shared form (``headrace.controlplane.structured.shared_masks``), plus
the time to pack them (control plane) and unpack them (worker, ``headrace.dataplane.bitmasks``).

The rows are real: ``--rows`` matchers of bench.structured_bench's JSON schema, each advanced
by random allowed tokens for ``--walk`` steps, their masks filled by the grammar engine. The
model only lends its tokenizer; write one with Qwen's vocabulary size over a tiny body:

    python -m bench.random_checkpoint qwen3-micro /tmp/micro-bl --tokenizer bytelevel --vocab-size
    151936 python -m bench.mask_wire_bench --model /tmp/micro-bl [--rows 64] [--walk 40] [--repeats
    200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from concurrent import futures

import grpc
import numpy as np

from bench.structured_bench import LONG
from headrace.common.grpc_options import server_options
from headrace.controlplane.structured import backends, shared_masks
from headrace.controlplane.structured.spec import Constraint
from headrace.controlplane.engine.worker_client import CHANNEL_OPTIONS
from headrace.dataplane import bitmasks
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc


class _Echo(wpb_grpc.WorkerServicer):
    def Execute(self, request_iterator, context):
        for step in request_iterator:
            yield wpb.StepResult(step_id=step.step_id)


def schema_rows(model: str, rows: int, walk: int, seed: int = 0) -> np.ndarray:
    """``rows`` masks of LONG's grammar after ``walk`` random allowed tokens each."""
    cfg = json.load(open(f"{model}/config.json"))
    vocab = cfg["vocab_size"]
    backend = backends.load(backends.resolve("auto"), model, vocab, [cfg["eos_token_id"]])
    compiled = backend.compile(Constraint("json", json.dumps(LONG)))
    matchers = [compiled.matcher() for _ in range(rows)]
    out = np.empty((rows, backends.bitmask_words(vocab)), dtype="<i4")
    rng = random.Random(seed)
    for step in range(walk + 1):
        backend.fill_rows(matchers, out, list(range(rows)))
        if step == walk:
            return out
        for i, m in enumerate(matchers):
            allowed = np.flatnonzero(np.unpackbits(out[i].view(np.uint8), bitorder="little"))
            m.accept(int(rng.choice(allowed)))


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


async def round_trips(port: int, messages: dict[str, wpb.StepRequest], repeats: int) -> dict[str, float]:
    """Median round trip (ms) of each message, interleaved so drift hits every form alike."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        queue: asyncio.Queue = asyncio.Queue()

        async def drain():
            while (m := await queue.get()) is not None:
                yield m

        call = wpb_grpc.WorkerStub(channel).Execute(drain())
        times: dict[str, list[float]] = {name: [] for name in messages}
        for _ in range(repeats):
            for name, msg in messages.items():
                t = time.perf_counter()
                queue.put_nowait(msg)
                await call.read()
                times[name].append(time.perf_counter() - t)
        queue.put_nowait(None)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint whose tokenizer spells text")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--walk", type=int, default=40, help="random allowed tokens before the masks")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    rows = schema_rows(args.model, args.rows, args.walk)
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    ids = list(range(1, args.rows + 1))
    plain = wpb.StepRequest(step_id=1, late_bitmask=True, bitmask=wpb.TokenBitmask(seq_ids=ids, bits=rows.tobytes()))
    shared = wpb.StepRequest(step_id=1, late_bitmask=True)
    shared.bitmask.seq_ids.extend(ids)
    shared_masks.pack(rows, shared.bitmask, shared_from=0)   # (the engine: from 128 KiB of rows)
    assert np.array_equal(bitmasks.rows_of(shared.bitmask, vocab), rows)
    empty = wpb.StepRequest(step_id=1)
    pack_ms = best_ms(lambda: shared_masks.pack(rows, wpb.TokenBitmask(seq_ids=ids), 0), args.repeats)
    unpack_ms = best_ms(lambda: bitmasks.arrays(shared.bitmask, np.array(ids), None, vocab), args.repeats)
    plain_read_ms = best_ms(lambda: bitmasks.arrays(plain.bitmask, np.array(ids), None, vocab), args.repeats)
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(256 << 20))
    wpb_grpc.add_WorkerServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rt = asyncio.run(round_trips(port, {"empty": empty, "plain": plain, "shared": shared}, args.repeats))
    finally:
        server.stop(None)
    masks = len(set(shared.bitmask.mask_of))
    listed = sum(1 for k in shared.bitmask.allowed_counts if k >= 0)
    print(json.dumps({"rows": args.rows, "vocab": vocab, "distinct_masks": masks, "listed_masks": listed,
                      "plain_bytes": plain.ByteSize(), "shared_bytes": shared.ByteSize(),
                      "round_trip_ms": rt, "pack_ms": pack_ms, "unpack_ms": unpack_ms,
                      "plain_read_ms": plain_read_ms}))
    print(f"\n| {args.rows} rows, vocabulary {vocab} | plain form | shared form |\n| --- | --- | --- |")
    print(f"| bytes ({masks} distinct masks, {listed} as token ids) | {plain.ByteSize():,} | {shared.ByteSize():,} |")
    print(f"| round trip, ms (an empty step: {rt['empty']:.3f}) | {rt['plain']:.3f} | {rt['shared']:.3f} |")
    print(f"| pack (control plane) / read (worker), ms | - / {plain_read_ms:.3f} | {pack_ms:.3f} / {unpack_ms:.3f} |")


if __name__ == "__main__":
    main()
