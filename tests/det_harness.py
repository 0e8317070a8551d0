"""Helpers of the ``--deterministic`` end-to-end tests: requests, an engine driving a worker in
this process over waves of them, and each request's output alone (cached per worker)."""

from __future__ import annotations

import asyncio

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.requests.validation import build_request
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker
from headrace.v1 import inference_pb2 as pb

MAX_TOKENS = 256   # the test workers' step limit; the engines' are at most this


def make_request(prompt, max_tokens, temperature, seed, n=1) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                              ignore_eos=True, logprobs=1, n=n, sampling=sampling)


async def serve_waves(worker: Worker, waves: list[list[pb.GenerateRequest]],
                 config: EngineConfig) -> tuple[list[list[tuple]], int]:
    """Each request's samples as (tokens, logprobs); wave k + 1 is submitted once wave k's
    first request has streamed a message. Returns them and the preemptions counted."""
    engine = Engine(InProcessWorkerGroup(worker), config)
    await engine.start(timeout=60)
    tok = ModelTokenizer(str(worker.opts.model))
    outs: list = []

    async def collect(req):
        samples = [([], []) for _ in range(req.n)]
        while not req.delivered:
            for msg in await req.next_responses():
                samples[msg.index][0].extend(msg.token_ids)
                samples[msg.index][1].extend(lp.logprob for lp in msg.logprobs)
        return [(tuple(t), tuple(lp)) for t, lp in samples]

    try:
        tasks = []
        for wave in waves:
            started = []
            for message in wave:
                req = build_request(message, tok, seq_ids=engine.seq_ids,
                                    vocab_size=engine.info.vocab_size,
                                    max_model_len=engine.max_model_len, eos_token_ids=[],
                                    deterministic=engine.deterministic)
                engine.submit(req)
                started.append(req)
                tasks.append(asyncio.ensure_future(collect(req)))
            while started and not started[0].delivered and not started[0].sequences[0].output_token_ids:
                await asyncio.sleep(0.001)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return outs, engine.scheduler.num_preemptions
    finally:
        await engine.stop()


def serve(worker, waves, **config) -> list:
    return asyncio.run(serve_waves(worker, waves, EngineConfig(**config)))[0]


_ALONE: dict = {}   # (worker, request) -> its samples alone


def alone(worker, message: pb.GenerateRequest) -> list:
    key = (id(worker), message.SerializeToString(deterministic=True))
    if key not in _ALONE:
        _ALONE[key] = serve(worker, [[message]], max_running=1, max_batched_tokens=MAX_TOKENS)[0]
    return _ALONE[key]


