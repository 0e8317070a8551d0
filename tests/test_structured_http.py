"""Structured outputs through the OpenAI-compatible HTTP API with the official ``openai``
client: ``response_format`` (json_schema with strict, json_object) on chat and completions,
vLLM's ``structured_outputs`` and ``guided_*`` extras, forced ``tool_choice`` answered as
``tool_calls`` (whole and streamed), and 400s naming the parameter."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from headrace.controlplane.http import structured
from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.protocol import ChatCompletionRequest, CompletionRequest
from headrace.controlplane.structured import backends
from headrace.dataplane.default_model import default_model_dir
from tests.harness import Planes

pytestmark = pytest.mark.skipif(not any(backends.installed(n) for n in ("guidance", "xgrammar")),
                                reason="no grammar engine installed")
CHAT = [{"role": "user", "content": "Good morning, Mr Darcy."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 18, "maximum": 90},
                                           "status": {"enum": ["single", "married"]}},
          "required": ["name", "age", "status"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "book_room", "parameters": {
             "type": "object", "properties": {"room": {"type": "integer", "minimum": 1, "maximum": 40},
                                              "guest": {"type": "string", "maxLength": 10}},
             "required": ["room", "guest"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "cancel", "parameters": {
             "type": "object", "properties": {"booking": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["booking"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client():
    planes = Planes(default_model_dir(), num_kv_blocks=256, plane_options={"http_port": 0})
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http.port}/v1", api_key="none",
                        max_retries=0, timeout=60)
    planes.close()


def test_chat_response_format_json_schema_strict(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, n=3,
                                         temperature=1.0, seed=5, response_format=fmt)
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_response_format_and_streaming(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=80, stream=True,
                                       extra_body={"response_format": fmt})
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=300, temperature=1.0,
                                         seed=1, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"[A-Z][a-z]+ [0-9]{2}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["Bath", "Brighton"]}}, lambda t: t in ("Bath", "Brighton")),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"grammar": 'root ::= "Mr. " [A-Z] [a-z]{2,6}'}},
     lambda t: re.fullmatch(r"Mr\. [A-Z][a-z]{2,6}", t)),
    ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "auto"}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= ("ab" | "cd"){2,3}'}, lambda t: re.fullmatch("(ab|cd){2,3}", t)),
])
def test_vllm_extras_on_completions(client, extra, check):
    out = client.completions.create(model="tiny", prompt="Lydia", max_tokens=80, temperature=1.0, seed=2,
                                    extra_body=extra)
    assert out.choices[0].finish_reason == "stop"
    assert check(out.choices[0].text), out.choices[0].text


def test_named_tool_choice_returns_tool_calls(client):
    choice = {"type": "function", "function": {"name": "book_room"}}
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, tools=TOOLS,
                                         tool_choice=choice)
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "book_room" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, tools=TOOLS,
                                            tool_choice=choice, stream=True)
    args, names, finish = "", set(), None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                assert tc.index == 0
                names.add(tc.function.name) if tc.function.name else None
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == {"book_room"} and finish == "stop"
    jsonschema.validate(json.loads(args), TOOLS[0]["function"]["parameters"])


def test_a_named_tool_without_parameters_is_called_with_none(client):
    """OpenAI: a function without ``parameters`` has an empty parameter list, so its arguments
    are ``{}`` (before: any object, whose first key the embedded model wrote to max_tokens)."""
    tools = [{"type": "function", "function": {"name": "ring_bell"}}]
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, tools=tools,
                                         tool_choice={"type": "function", "function": {"name": "ring_bell"}})
    c = out.choices[0]
    assert c.finish_reason == "stop"
    (call,) = c.message.tool_calls
    assert call.function.name == "ring_bell" and json.loads(call.function.arguments) == {}


def test_required_tool_choice_returns_calls_of_the_given_tools(client):
    """One call (parallel_tool_calls false): the embedded model, left to it, lists calls
    until max_tokens; then the text comes back as content, a prefix of an array of calls."""
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, tools=TOOLS,
                                         tool_choice="required")
    c = out.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert c.message.content.startswith('[{"name": "')
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=CHAT, max_tokens=200, tools=TOOLS, tool_choice="required",
                      temperature=1.0, seed=3, parallel_tool_calls=False)
        if stream:
            calls, finish = [], None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for ch in chunk.choices:
                    calls += ch.delta.tool_calls or []
                    finish = ch.finish_reason or finish
        else:
            out = client.chat.completions.create(**kwargs)
            calls, finish = out.choices[0].message.tool_calls, out.choices[0].finish_reason
        assert finish == "tool_calls" and calls
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
    ({"guided_json": {"type": "frobnicate"}}, "response_format", "json_schema does not compile"),
    ({"guided_regex": "(a"}, "response_format", "regex does not compile"),
    ({"guided_choice": "yes"}, "guided_choice", "valid array"),
])
def test_bad_constraints_are_400s_naming_the_parameter(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra)
    err = info.value.body
    assert words in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"


def test_tool_choice_problems():
    def body(**kw):
        return ChatCompletionRequest.model_validate({"messages": CHAT, **kw})

    for kw, words in ((dict(tool_choice="required"), "needs tools"),
                      (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "dance"}}), "'dance'"),
                      (dict(tools=TOOLS, tool_choice={"type": "other"}), "tool_choice must be"),
                      (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                       "not several")):
        with pytest.raises(HttpError, match=words):
            structured.constraint(body(**kw), chat=True)
    assert structured.constraint(body(tools=TOOLS, tool_choice="auto"), chat=True) == (None, None)
    msg, mode = structured.constraint(body(tools=TOOLS, tool_choice={"type": "function",
                                                                      "function": {"name": "cancel"}}), chat=True)
    assert mode == "cancel" and json.loads(msg.json_schema) == TOOLS[1]["function"]["parameters"]
    assert structured.constraint(CompletionRequest.model_validate({"prompt": "x"}), chat=False) == (None, None)
