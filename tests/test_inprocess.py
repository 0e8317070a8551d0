"""headrace.dataplane.inprocess: the control plane's engine drives a worker in this process
(composed here, above both planes) and gives the same greedy tokens as the planes over gRPC; the
launch hook sees every step; a receive with nothing ready fails clearly."""

from __future__ import annotations

import asyncio

import pytest

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.requests.validation import build_request
from headrace.dataplane.default_model import default_model_dir
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion

MODEL = str(default_model_dir())
PROMPTS = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2]]
MAX_TOKENS = 6


def _worker() -> Worker:
    return Worker(WorkerOptions(model=MODEL, device="cpu", dtype="float32", num_kv_blocks=64,
                                max_num_seqs=8, max_batched_tokens=256))


async def _generate(group: InProcessWorkerGroup) -> list[list[int]]:
    engine = Engine(group, EngineConfig(max_running=8, max_batched_tokens=256))
    await engine.start(timeout=30)
    tok = ModelTokenizer(MODEL)
    requests = []
    for prompt in PROMPTS:
        req = build_request(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS,
                                               ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0)),
                            tok, seq_ids=engine.seq_ids, vocab_size=engine.info.vocab_size,
                            max_model_len=engine.max_model_len, eos_token_ids=[])
        engine.submit(req)
        requests.append(req)

    async def tokens(req) -> list[int]:
        out = []
        while not req.delivered:
            for msg in await req.next_responses():
                out += list(msg.token_ids)
        return out

    try:
        return await asyncio.wait_for(asyncio.gather(*(tokens(r) for r in requests)), 60)
    finally:
        await engine.stop()


def test_engine_in_one_process_matches_the_planes_over_grpc():
    launched = []

    def hook(step, launch):
        launched.append(step.step_id)
        return launch()

    ours = asyncio.run(_generate(InProcessWorkerGroup(_worker(), launch_hook=hook)))
    assert [len(t) for t in ours] == [MAX_TOKENS] * len(PROMPTS)
    assert len(launched) >= MAX_TOKENS and launched == sorted(launched)   # every step, in order

    planes = Planes(MODEL, num_kv_blocks=64)
    try:
        served = [completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=p), max_tokens=MAX_TOKENS,
                                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.0)))[0]
                  for p in PROMPTS]
    finally:
        planes.close()
    assert ours == served


def test_send_returns_ready_results_and_receive_without_one_fails_clearly():
    async def run():
        group = InProcessWorkerGroup(_worker())
        [info] = await group.describe(timeout=1)
        assert group.num_kv_blocks == info.num_kv_blocks == 64
        await group.open()
        with pytest.raises(RuntimeError, match="no step result is ready"):
            await group.receive()
        new = wpb.NewSequence(seq_id=1, prompt_token_ids=[5, 17, 300], block_ids=[0],
                              num_scheduled_tokens=3, sampling=wpb.Sampling(temperature=0.0))
        ready = await group.send(wpb.StepRequest(step_id=1, new_seqs=[new], flush=True))
        assert [r.step_id for r in ready] == [1]
        result = await group.receive()
        assert list(result.seq_ids) == [1] and len(result.token_ids) == 1
        await group.close()

    asyncio.run(run())
