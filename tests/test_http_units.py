"""Units of the HTTP front end without a server: the watched ASGI response (errors, a client that
leaves), OpenAI bodies -> GenerateRequest, error mapping, and sampling defaults."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from headrace.controlplane.http import convert
from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.protocol import ChatCompletionRequest, CompletionRequest
from headrace.controlplane.http.responses import Watched, event_stream
from headrace.controlplane.requests.path import RequestError
from headrace.controlplane.requests.sampling_defaults import SamplingDefaults
from headrace.v1 import inference_pb2 as pb


def _drive(app, disconnect_after: float | None = None):
    sent = []

    async def receive():
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http"}, receive, send))
    return sent


def test_a_bug_is_a_500_error_object_without_a_trace():
    async def work(send):
        raise RuntimeError("secret internals")

    sent = _drive(Watched(work))
    assert sent[0]["status"] == 500
    body = json.loads(sent[1]["body"])
    assert body["error"]["type"] == "server_error" and "secret" not in sent[1]["body"].decode()


def test_an_error_before_the_first_chunk_gets_its_status_and_a_leaving_client_cancels():
    async def refused():
        raise HttpError(429, "queue is full")
        yield b""  # pragma: no cover

    errors = []
    sent = _drive(event_stream(refused(), on_error=errors.append))
    assert sent[0]["status"] == 429 and errors[0].status == 429

    closed, gone = [], []

    async def endless():
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    sent = _drive(event_stream(endless(), on_gone=lambda: gone.append(True)), disconnect_after=0.1)
    assert sent[0]["status"] == 200 and len(sent) > 3 and closed == [True] and gone == [True]


def test_completion_bodies():
    body = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "n": 2, "stop": "x", "seed": 5,
                                             "top_k": -1, "logprobs": 0, "request_id": "r"})
    a, b = convert.completion_requests(body)
    assert list(a.prompt_token_ids.ids) == [1, 2] and list(b.prompt_token_ids.ids) == [3]
    assert (a.request_id, b.request_id) == ("r-0", "r-1")
    assert a.max_tokens == 16 and a.n == 2 and list(a.stop) == ["x"] and a.sampling.seed == 5
    assert a.sampling.top_k == 0 and a.logprobs == 1 and not a.sampling.HasField("temperature")
    biased = convert.completion_requests(CompletionRequest.model_validate(
        {"prompt": "x", "logit_bias": {"7": 2.5, "50256": -100}}))[0]
    assert dict(biased.sampling.logit_bias) == {7: 2.5, 50256: -100.0}
    for bad, param in (({"prompt": "x", "logit_bias": {"one": 2}}, "logit_bias"),
                       ({"prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias"),
                       ({"prompt": "x", "echo": True}, "echo"), ({"prompt": []}, "prompt"),
                       ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options")):
        with pytest.raises(HttpError) as info:
            convert.completion_requests(CompletionRequest.model_validate(bad))
        assert info.value.status == 400 and info.value.param == param


def test_chat_bodies():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                     {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"}],
        "max_tokens": 9, "max_completion_tokens": 7, "logprobs": True,
        "chat_template_kwargs": {"enable_thinking": False}, "tools": [{"type": "function"}]})
    req = convert.chat_request(body)
    m = req.messages.messages
    assert req.max_tokens == 7 and req.logprobs == 1 and m[0].content == "a\nb"
    assert json.loads(m[1].extra_json)["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert json.loads(m[2].extra_json) == {"tool_call_id": "c1"} and m[2].name == "f"
    assert json.loads(req.messages.template_kwargs_json) == {"enable_thinking": False}
    assert json.loads(req.messages.tools_json) == [{"type": "function"}]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(HttpError, match="only text"):
        convert.chat_request(ChatCompletionRequest.model_validate(image))
    with pytest.raises(HttpError) as info:
        convert.chat_request(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}))
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("code,message,chat,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1]", False, 400, "top_p"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt has 5000 tokens; max_model_len is 1024", True, 400, "messages"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt 9 tokens + max_tokens 1024 > max_model_len 1024: shorten the "
                                       "prompt or lower max_tokens to at most 1015", True, 400, "max_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: token id 9 is out", False, 400, "prompt"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full", False, 429, None),
    (grpc.StatusCode.UNAVAILABLE, "server is draining", False, 503, None),
    (grpc.StatusCode.INTERNAL, "boom", False, 500, None),
])
def test_request_errors_map_to_http(code, message, chat, status, param):
    error = HttpError.from_request_error(RequestError(code, message), chat)
    assert (error.status, error.param) == (status, param)
    assert error.body()["error"]["message"] == message


def test_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 50}))
    d = SamplingDefaults.load(tmp_path)
    assert d.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20} and d.max_tokens == 50
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=0.0))
    out = d.apply(req)
    assert out.sampling.temperature == 0.0 and out.sampling.top_k == 20
    assert out.sampling.top_p == pytest.approx(0.95) and not req.sampling.HasField("top_p")
    assert SamplingDefaults.load(tmp_path, "vllm").apply(req) is req
    assert SamplingDefaults.load(tmp_path / "none").values == {}


@pytest.mark.parametrize("chat", [True, False])
def test_fast_text_events_equal_the_full_chunks(chat):
    from headrace.controlplane.http.streaming import Formatter

    fmt = Formatter(chat, 'ti"ny ✓', 2, None, str)
    msg = pb.GenerateResponse(token_ids=[5], text=' he"llo ✓\n\\', index=1)
    for usage in (True, False):
        event = fmt.sse(3, msg, False, usage)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
        expected = fmt.chunk(3, msg, False) | ({"usage": None} if usage else {})
        assert json.loads(event[6:]) == expected and expected["choices"][0]["index"] == 7


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": True}, "max_tokens"), ({"n": "2"}, "n"), ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"), ({"seed": "7"}, "seed"), ({"temperature": "0.5"}, "temperature"),
    ({"logprobs": True}, "logprobs"), ({"ignore_eos": "false"}, "ignore_eos"),
    ({"prompt": [1, True]}, "prompt"), ({"top_k": 2.5}, "top_k"),
])
def test_wrong_json_types_are_refused_naming_the_field(body, field):
    import pydantic

    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **body}))
    assert err.value.errors()[0]["loc"][0] == field


def test_json_numbers_take_the_field_type_they_can_be():
    body = CompletionRequest.model_validate_json(json.dumps(
        {"prompt": [1, 2.0], "max_tokens": 16.0, "n": 2, "temperature": 1, "top_p": 1}))
    assert body.prompt == [1, 2] and body.max_tokens == 16 and body.temperature == 1.0
    assert isinstance(body.max_tokens, int) and isinstance(body.temperature, float)
    chat = ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2.0}))
    assert chat.logprobs is True and chat.top_logprobs == 2
