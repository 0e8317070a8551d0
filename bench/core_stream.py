"""The engine core → front end stream's own cost per engine step, without sockets or other
processes (steady, so before/after comparisons hold on a busy machine): ``--running`` samples
each gain one token per step; the core's ``FrontendLink`` is woken for every request, flushes,
hands out its ``Down`` message and serializes it; the front end's ``CoreClient`` parses it and
applies it to its requests. Prints the median µs per step of each side as one JSON line.

    python -m bench.core_stream --running 256 --steps 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import types

from headrace.controlplane.core.service import CoreRequest, CoreText, FrontendLink
from headrace.controlplane.frontend.client import CoreClient
from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.requests.request import Request, Sequence, Status
from headrace.core.v1 import core_pb2 as cpb
from headrace.worker.v1 import worker_pb2 as wpb


class _Text:
    def step(self, token_id):
        return "x"

    def flush(self):
        return ""


def _seq(request, handle: int, output) -> Sequence:
    return Sequence(request=request, seq_id=handle, index=0, prompt_token_ids=[5] * 100,
                    sampling=wpb.Sampling(), max_tokens=10**9, output=output, status=Status.RUNNING)


async def measure(running: int, steps: int) -> dict:
    engine = types.SimpleNamespace(scheduler=None)
    link = FrontendLink(types.SimpleNamespace(plane=types.SimpleNamespace(engine=engine)))
    client = CoreClient("unix:/nonexistent", 0, None)
    requests = []
    for handle in range(1, running + 1):
        req = CoreRequest(request_id=f"r{handle}", link=link, handle=handle)
        req.sequences = [_seq(req, handle, CoreText(False))]
        link.requests[handle] = req
        mirror = Request(request_id=req.request_id)
        mirror.sequences = [_seq(mirror, handle, OutputText(_Text(), []))]
        mirror.core_handle = handle
        client.requests[mirror.request_id], client._by_handle[handle] = mirror, mirror
        requests.append(req)
    core, front = [], []
    for _ in range(steps):
        for req in requests:
            req.sequences[0].output_token_ids.append(7)
        t0 = time.perf_counter()
        for req in requests:
            req.notify()
        link.flush()
        data = (await link.next_message()).SerializeToString()
        t1 = time.perf_counter()
        client._apply(cpb.Down.FromString(data))
        front.append(time.perf_counter() - t1)
        core.append(t1 - t0)
    assert all(m.sequences[0].output_token_ids == r.sequences[0].output_token_ids
               for m, r in zip(client.requests.values(), requests))
    return {"running": running, "steps": steps, "bytes_per_step": len(data),
            "core_us_per_step": round(1e6 * statistics.median(core)),
            "frontend_us_per_step": round(1e6 * statistics.median(front))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256, help="samples running (one request each)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(measure(args.running, args.steps))))


if __name__ == "__main__":
    main()
