"""The OpenAI-compatible HTTP API driven by the official ``openai`` package against live planes
serving the embedded model: chat and completions, streaming and not, n > 1, logprobs, stop,
usage, and errors mapped to the SDK's exception types; plus gRPC chat on the same request path."""

from __future__ import annotations

import grpc
import openai
import pytest

from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes

TOKEN = "s3cret"
CHAT = [{"role": "system", "content": "A ball at Netherfield."},
        {"role": "user", "content": "Good morning, Mr Darcy."}]


@pytest.fixture(scope="module")
def planes():
    planes = Planes(default_model_dir(), num_kv_blocks=256,
                    plane_options={"http_port": 0, "api_token": TOKEN})
    yield planes
    planes.close()


@pytest.fixture(scope="module")
def client(planes):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http.port}/v1", api_key=TOKEN,
                         max_retries=0, timeout=60)


def test_chat_matches_grpc_chat_and_the_rendered_prompt(planes, client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    # the same conversation through gRPC's messages gives the same greedy text and prompt
    grpc_chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    responses = list(planes.stub.Generate(pb.GenerateRequest(
        messages=grpc_chat, max_tokens=12, sampling=pb.SamplingParams(temperature=0)),
        metadata=[("authorization", f"Bearer {TOKEN}")]))
    assert "".join(r.text for r in responses) == choice.message.content
    prompt = planes.plane.requests.chat_template.render(CHAT)
    ids = planes.plane.tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 0 and ids[1] != 0   # the template's BOS, not a second one from the tokenizer
    assert out.usage.prompt_tokens == responses[-1].usage.prompt_tokens == len(ids)
    assert out.usage.total_tokens == len(ids) + 12
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_n2_with_usage(client):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, n=2,
                                            temperature=1.0, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    texts, roles, finish, usage = {0: "", 1: ""}, set(), {}, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        roles.add((c.index, c.delta.role))
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"} and {(0, "assistant"), (1, "assistant")} <= roles
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12
    again = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, n=2,
                                           temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [texts[0], texts[1]]


def test_completions_prompts_n_logprobs_and_stop(client):
    out = client.completions.create(model="tiny", prompt=["It is a truth", "Mr Bennet"], n=2,
                                    max_tokens=5, temperature=0, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text   # greedy samples of one prompt agree
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 5 and "".join(lp.tokens) == c.text
        assert all(len(top) <= 2 and max(top.values()) >= v - 1e-5
                   for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert out.usage.completion_tokens == 20
    full = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=20, temperature=0)
    text = full.choices[0].text
    stop = text.strip().split()[2]
    cut = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=20,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="It is a truth", max_tokens=20, temperature=0, stream=True))
    assert streamed == text


def test_logit_bias_forces_and_bans_tokens(planes, client):
    """OpenAI's logit_bias (token id strings -> [-100, 100]) and gRPC's ``sampling.logit_bias``:
    +100 all but forces a token at any temperature, -100 bans one; logprobs stay the model's."""
    auth = [("authorization", f"Bearer {TOKEN}")]

    def grpc_ids(**sampling) -> list[int]:
        out = planes.stub.Generate(pb.GenerateRequest(prompt="It is a truth", max_tokens=5,
                                                      sampling=pb.SamplingParams(**sampling)), metadata=auth)
        return [t for r in out for t in r.token_ids]

    first = grpc_ids(temperature=0)[0]
    assert grpc_ids(temperature=0, logit_bias={first: -100})[0] != first
    assert grpc_ids(temperature=1.5, seed=4, logit_bias={first: 100}) == [first] * 5
    greedy = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=5, temperature=0,
                                       logprobs=1).choices[0].logprobs
    banned = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=5, temperature=0,
                                       logprobs=1, logit_bias={str(first): -100}).choices[0].logprobs
    assert banned.tokens[0] != greedy.tokens[0] and greedy.tokens[0] not in banned.tokens
    forced = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=1.5,
                                            seed=4, logprobs=True, logit_bias={str(first): 100})
    content = forced.choices[0].logprobs.content
    assert [t.token for t in content] == [greedy.tokens[0]] * 5
    assert all(t.logprob < -1e-3 for t in content)   # the model's, not the biased distribution's


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("kwargs,error,param", [
    (dict(temperature=-1), openai.BadRequestError, "temperature"),
    (dict(top_p=0), openai.BadRequestError, "top_p"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(max_tokens=10**6), openai.BadRequestError, "max_tokens"),
    (dict(n=0), openai.BadRequestError, "n"),
    (dict(logit_bias={"5": 101}), openai.BadRequestError, "logit_bias"),
    (dict(logit_bias={"99999": 1}), openai.BadRequestError, "logit_bias"),
    (dict(logit_bias={"five": 1}), openai.BadRequestError, "logit_bias"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "user", "content": "x " * 3000}]), openai.BadRequestError, "messages"),
    (dict(model="gpt-4"), openai.NotFoundError, "model"),
])
def test_errors_map_to_sdk_exceptions(planes, client, kwargs, error, param):
    args = dict(model="tiny", messages=CHAT, max_tokens=4) | kwargs
    with pytest.raises(error) as info:
        client.chat.completions.create(**args)
    body = info.value.body
    assert body["param"] == param and body["message"] and "Traceback" not in body["message"]


def test_auth_queue_full_and_draining(planes, client):
    base = client.base_url
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    engine = planes.engine
    engine.config.max_queued = -1   # any waiting count is "full"
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
    finally:
        engine.config.max_queued = 0
    engine.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        engine.draining = False
    errors = planes.plane.metrics.registry.get_sample_value
    assert errors("headrace:request_errors_total", {"method": "Completions", "code": "UNAVAILABLE",
                                                    "api": "http"}) == 1
    assert errors("headrace:request_errors_total", {"method": "Completions",
                                                    "code": "RESOURCE_EXHAUSTED", "api": "http"}) == 1
    assert errors("headrace:api_requests_total", {"api": "http", "method": "ChatCompletions"}) >= 1


def test_model_without_template_is_invalid_argument(planes, client):
    template = planes.plane.requests.chat_template
    planes.plane.requests.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
        with pytest.raises(grpc.RpcError) as info:
            planes.stub.Generate(pb.GenerateRequest(messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="hi")])),
                metadata=[("authorization", f"Bearer {TOKEN}")]).next()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no chat template" in info.value.details()
    finally:
        planes.plane.requests.chat_template = template
