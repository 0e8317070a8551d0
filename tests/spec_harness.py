"""An in-process engine over a worker with or without ``--speculative-config`` (tests of
speculative decoding compare the two): submit requests, collect every sample's tokens."""

from __future__ import annotations

import asyncio
import json

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.requests.validation import build_request
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import inference_pb2 as pb

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def worker(model: str, spec: dict | None, **options) -> Worker:
    opts = dict(model=model, device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=16,
                max_batched_tokens=256, block_size=4)
    opts.update(options)
    return Worker(WorkerOptions(**opts, speculative_config=json.dumps(spec) if spec else None))


async def run(model: str, worker: Worker, requests: list[dict], config: EngineConfig | None = None,
              abort_after: dict[int, int] | None = None):
    """Submits ``requests`` (GenerateRequest fields) at once; returns (per request: per sample
    (tokens, text, finish reason, logprobs)), the engine). ``abort_after``: request index ->
    abort it once that many tokens arrived."""
    engine = Engine(InProcessWorkerGroup(worker), config or EngineConfig(max_running=16,
                                                                          max_batched_tokens=256))
    await engine.start(timeout=30)
    tok = ModelTokenizer(model)
    reqs = []
    for fields in requests:
        req = build_request(pb.GenerateRequest(**fields), tok, seq_ids=engine.seq_ids,
                            vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                            eos_token_ids=list(engine.info.eos_token_ids))
        engine.submit(req)
        reqs.append(req)

    async def collect(i, req):
        out = {}
        while not req.delivered:
            for msg in await req.next_responses():
                tokens, text, reason, lps = out.get(msg.index, ([], "", 0, []))
                tokens = tokens + list(msg.token_ids)
                lps = lps + [(lp.token_id, round(lp.logprob, 4)) for lp in msg.logprobs]
                out[msg.index] = (tokens, text + msg.text, msg.finish_reason or reason, lps)
                if abort_after and i in abort_after and len(tokens) >= abort_after[i]:
                    engine.abort(req)
                    return [out[k] for k in sorted(out)]
        return [out[k] for k in sorted(out)]

    try:
        results = await asyncio.wait_for(asyncio.gather(*(collect(i, r) for i, r in enumerate(reqs))), 120)
        for _ in range(50):   # let the loop fold what is in flight
            if not engine._inflight:
                break
            await asyncio.sleep(0.01)
        return results, engine
    finally:
        await engine.stop()
