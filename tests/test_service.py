"""The public service over real gRPC: concurrency, validation, cancellation, stop rules,
sampling determinism, Tokenize, GetModelInfo, health and reflection."""

from __future__ import annotations

import concurrent.futures
import math
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.harness import DEVICE, completion
from headrace.v1 import inference_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0)


def test_64_concurrent_requests_finish_and_free_their_blocks(llama_planes):
    start_free = llama_planes.free_blocks
    rng = random.Random(7)
    jobs = [([rng.randrange(2, 384) for _ in range(rng.randrange(1, 60))], rng.randrange(1, 40))
            for _ in range(64)]

    def run(job):
        prompt, n = job
        return prompt, n, llama_planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt),
                                                max_tokens=n, ignore_eos=True, sampling=GREEDY)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, jobs))
    for prompt, n, responses in results:
        ids, _, reason = completion(responses)
        assert len(ids) == n and reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.prompt_tokens == len(prompt)
        assert responses[-1].usage.completion_tokens == n
    # greedy output does not depend on the batch: rerun two of them alone
    for prompt, n, responses in results[:2]:
        alone = llama_planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n,
                                      ignore_eos=True, sampling=GREEDY)
        assert completion(alone)[0] == completion(responses)[0]
    assert llama_planes.wait_for_free_blocks(start_free) == start_free


BAD_REQUESTS = [
    ("prompt", dict(prompt="")),
    ("prompt", dict()),
    ("prompt_token_ids", dict(prompt_token_ids=pb.TokenIds(ids=[]))),
    ("out of vocabulary", dict(prompt_token_ids=pb.TokenIds(ids=[5, 384]))),
    ("max_model_len", dict(prompt_token_ids=pb.TokenIds(ids=[5] * 256))),
    ("max_model_len", dict(prompt="the " * 400)),
    ("sampling.temperature", dict(prompt="hi", sampling=pb.SamplingParams(temperature=-0.5))),
    ("sampling.temperature", dict(prompt="hi", sampling=pb.SamplingParams(temperature=math.nan))),
    ("sampling.top_p", dict(prompt="hi", sampling=pb.SamplingParams(top_p=0.0))),
    ("sampling.top_p", dict(prompt="hi", sampling=pb.SamplingParams(top_p=1.5))),
    ("sampling.top_k", dict(prompt="hi", sampling=pb.SamplingParams(top_k=-1))),
    ("sampling.min_p", dict(prompt="hi", sampling=pb.SamplingParams(min_p=2))),
    ("sampling.repetition_penalty", dict(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0))),
    ("sampling.presence_penalty", dict(prompt="hi", sampling=pb.SamplingParams(presence_penalty=3))),
    ("max_tokens", dict(prompt="hi", max_tokens=0)),
    ("max_tokens", dict(prompt="hi", max_tokens=-3)),
    ("max_tokens", dict(prompt="hi", max_tokens=2**31 - 1)),
    ("min_tokens", dict(prompt="hi", max_tokens=2, min_tokens=5)),
    ("logprobs", dict(prompt="hi", logprobs=-1)),
    ("logprobs", dict(prompt="hi", logprobs=1000)),
    ("stop", dict(prompt="hi", stop=[""])),
    ("stop", dict(prompt="hi", stop=["x"] * 10_000)),
    ("stop_token_ids", dict(prompt="hi", stop_token_ids=[10**6])),
]


@pytest.mark.parametrize("field,fields", BAD_REQUESTS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_is_invalid_argument_naming_the_field(llama_planes, field, fields):
    with pytest.raises(grpc.RpcError) as info:
        llama_planes.generate(**fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    # and the server keeps serving
    ok = llama_planes.generate(prompt="hello", max_tokens=2, ignore_eos=True)
    assert completion(ok)[2] == pb.FINISH_REASON_LENGTH


def test_cancel_mid_stream_frees_blocks(llama_planes):
    start_free = llama_planes.free_blocks
    call = llama_planes.stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=list(range(2, 150))), max_tokens=100, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    assert llama_planes.free_blocks < start_free
    call.cancel()
    assert llama_planes.wait_for_free_blocks(start_free) == start_free
    assert not llama_planes.engine.requests


def test_deadline_exceeded_frees_blocks(llama_planes):
    start_free = llama_planes.free_blocks
    with pytest.raises(grpc.RpcError) as info:
        list(llama_planes.stub.Generate(pb.GenerateRequest(
            prompt="the quick", max_tokens=200, ignore_eos=True), timeout=0.05))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert llama_planes.wait_for_free_blocks(start_free) == start_free


def test_stop_token_and_eos(llama_planes):
    base = llama_planes.generate(prompt="the quick", max_tokens=10, ignore_eos=True, sampling=GREEDY)
    ids, _, _ = completion(base)
    stop_at = ids[4]
    first = ids.index(stop_at)
    stopped = llama_planes.generate(prompt="the quick", max_tokens=10, stop_token_ids=[stop_at],
                                    sampling=GREEDY)
    s_ids, _, reason = completion(stopped)
    assert reason == pb.FINISH_REASON_STOP and s_ids == ids[:first + 1]
    # min_tokens suppresses the stop token until reached
    late = llama_planes.generate(prompt="the quick", max_tokens=10, stop_token_ids=[stop_at],
                                 min_tokens=first + 2, sampling=GREEDY)
    l_ids, _, _ = completion(late)
    assert stop_at not in l_ids[:first + 2]



@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_the_worker_alone_decides_a_stop_token_and_min_tokens(llama_planes, min_tokens):
    """Every id of the vocabulary is a stop token: the worker finds the first token out once
    min_tokens outputs are (itself included) a stop token, and the control plane finishes the
    request there (FINISH_REASON_STOP, the stop token's text not returned) on that verdict
    alone. Had the two planes disagreed, the sequence would run on (or hang) past it."""
    vocab = llama_planes.stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    responses = llama_planes.generate(prompt="the quick", max_tokens=10, ignore_eos=True,
                                      stop_token_ids=list(range(vocab)), min_tokens=min_tokens,
                                      sampling=GREEDY)
    ids, _, reason = completion(responses)
    assert reason == pb.FINISH_REASON_STOP and len(ids) == max(1, min_tokens)
    assert responses[-1].usage.completion_tokens == len(ids)

def test_stop_string_is_cut_across_chunks(llama_planes):
    base = llama_planes.generate(prompt="the quick", max_tokens=12, ignore_eos=True, sampling=GREEDY)
    _, text, _ = completion(base)
    assert len(text) >= 6
    stop = text[3:6]
    cut = text.index(stop)
    stopped = llama_planes.generate(prompt="the quick", max_tokens=12, ignore_eos=True, stop=[stop],
                                    sampling=GREEDY)
    _, s_text, reason = completion(stopped)
    assert reason == pb.FINISH_REASON_STOP_STRING
    assert s_text == text[:cut]


def test_seeded_sampling_is_reproducible_whatever_the_neighbours(llama_planes):
    req = dict(prompt="the quick brown", max_tokens=16, ignore_eos=True,
               sampling=pb.SamplingParams(temperature=1.0, top_k=50, seed=1234))
    alone = completion(llama_planes.generate(**req))[0]

    def noisy(_):
        return llama_planes.generate(prompt="fox", max_tokens=20, ignore_eos=True)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        crowd = [pool.submit(noisy, i) for i in range(4)]
        again = pool.submit(lambda: llama_planes.generate(**req))
        assert completion(again.result())[0] == alone
        [f.result() for f in crowd]
    other_seed = dict(req, sampling=pb.SamplingParams(temperature=1.0, top_k=50, seed=99))
    assert completion(llama_planes.generate(**other_seed))[0] != alone


def test_tokenize_and_model_info(llama_planes):
    tok = llama_planes.stub.Tokenize(pb.TokenizeRequest(text="the quick brown fox"))
    assert tok.token_ids and len(tok.tokens) == len(tok.token_ids)
    from_text = llama_planes.generate(prompt="the quick brown fox", max_tokens=4, sampling=GREEDY,
                                      ignore_eos=True)
    from_ids = llama_planes.generate(prompt_token_ids=pb.TokenIds(ids=tok.token_ids), max_tokens=4,
                                     sampling=GREEDY, ignore_eos=True)
    assert completion(from_text)[0] == completion(from_ids)[0]
    info = llama_planes.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 384
    assert info.max_model_len == 256 and info.kv_block_size == 16 and info.num_kv_blocks == 512
    assert info.device == DEVICE and info.dtype == "float32" and info.tensor_parallel_size == 1


def test_request_id_is_echoed_and_assigned(llama_planes):
    named = llama_planes.generate(request_id="abc-1", prompt="hi", max_tokens=2)
    assert {r.request_id for r in named} == {"abc-1"}
    anonymous = llama_planes.generate(prompt="hi", max_tokens=2)
    assert len({r.request_id for r in anonymous}) == 1 and anonymous[0].request_id


def test_health_and_reflection(llama_planes):
    health = health_pb2_grpc.HealthStub(llama_planes.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="headrace.v1.Inference")).status == \
        health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(llama_planes.channel)
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"headrace.v1.Inference", "grpc.health.v1.Health"} <= names


def test_text_streams_in_pieces_that_join_to_the_full_decode(llama_planes):
    responses = llama_planes.generate(prompt="héllo wörld", max_tokens=20, ignore_eos=True,
                                      sampling=pb.SamplingParams(temperature=0))
    ids, text, _ = completion(responses)
    assert text == llama_planes.plane.tokenizer.decode(ids)
    assert len(responses) >= 2


def test_stream_interval_batches_tokens_per_message(llama_planes):
    """The first token comes alone (at once: the TTFT waits for no interval); every message
    after it but the last holds at least stream_interval tokens; an interval of max_tokens or
    more gives the whole completion in one message; the tokens are the same."""
    prompt = dict(prompt_token_ids=pb.TokenIds(ids=[5, 9, 13]), max_tokens=11, ignore_eos=True,
                  sampling=GREEDY)
    every = llama_planes.generate(**prompt)
    chunked = llama_planes.generate(**prompt, stream_interval=4)
    whole = llama_planes.generate(**prompt, stream_interval=1000)
    assert completion(chunked)[0] == completion(whole)[0] == completion(every)[0]
    assert len(chunked[0].token_ids) == 1
    assert all(len(r.token_ids) >= 4 for r in chunked[1:-1]) and len(chunked) <= 4
    assert len(whole) == 1 and whole[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(every) > len(chunked)
