"""Structured outputs on the OpenAI-compatible API: the request body's constraint as a
``StructuredOutputs`` message, from whichever way the client states it:

* OpenAI's ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``text``: none);
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``;
* vLLM's older extras ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (and ``guided_decoding_backend``);
* chat's ``tool_choice``: a named function (``{"type": "function", "function": {"name"}}``)
  constrains the output to that tool's ``parameters`` schema, ``"required"`` to a JSON array of
  calls (``[{"name", "parameters"}]``) of the given tools (one, with ``parallel_tool_calls:
  false``); the response then carries
  ``tool_calls`` (``headrace.controlplane.http.tool_calls``). ``"auto"`` and ``"none"`` constrain nothing.

At most one of them may be given; every problem is a 400 naming the parameter.
"""

from __future__ import annotations

import json
from typing import Any

from headrace.controlplane.http.errors import HttpError
from headrace.v1 import inference_pb2 as pb

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
UNSUPPORTED_KEYS = ("structural_tag",)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value   # checked (as JSON) by the request path
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise HttpError(400, f"{param} must be a JSON Schema (an object)", param)


def _one(kind: str, value: Any, param: str, backend: str = "") -> pb.StructuredOutputs:
    msg = pb.StructuredOutputs(backend=backend or "")
    if kind == "json":
        msg.json_schema = _schema_text(value, param)
    elif kind == "json_object":
        if value is not True:
            raise HttpError(400, f"{param} must be true", param)
        msg.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise HttpError(400, f"{param} must be a list of strings", param)
        msg.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise HttpError(400, f"{param} must be a string", param)
        setattr(msg, kind, value)
    return msg


def _response_format(fmt: dict) -> pb.StructuredOutputs | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return pb.StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise HttpError(400, "response_format.json_schema.schema is required", "response_format")
        return _one("json", spec["schema"], "response_format")
    raise HttpError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                         "json_schema)", "response_format")


def _structured_outputs(so: dict, backend: str) -> pb.StructuredOutputs:
    for key in UNSUPPORTED_KEYS:
        if so.get(key) is not None:
            raise HttpError(400, f"structured_outputs.{key} is not supported", "structured_outputs")
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise HttpError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, "
                             "json_object", "structured_outputs")
    return _one(given[0], so[given[0]], f"structured_outputs.{given[0]}", backend)


def _tool_schema(body) -> tuple[pb.StructuredOutputs | None, Any]:
    """The constraint a chat's ``tool_choice`` asks for, and the tool mode (None, the named
    function's name, or ``"required"``)."""
    choice, tools = body.tool_choice, body.tools or []
    if choice in (None, "none", "auto"):
        return None, None
    functions = [t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if choice == "required":
        if not functions:
            raise HttpError(400, "tool_choice 'required' needs tools", "tool_choice")
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f.get("name")]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return pb.StructuredOutputs(json_schema=json.dumps(schema)), "required"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise HttpError(400, "tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    for f in functions:
        if f.get("name") == name:
            return pb.StructuredOutputs(json_schema=json.dumps(_parameters(f))), name
    raise HttpError(400, f"tool_choice names the function {name!r}, which tools do not have", "tool_choice")


def tool_mode(body) -> str | None:
    """How a chat's answer is shaped: the named function's name, ``"required"``, or None."""
    choice = body.tool_choice
    if choice == "required":
        return "required"
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    return None


def _parameters(function: dict) -> dict:
    """A function's arguments schema. Without ``parameters`` it takes none (OpenAI: "omitting
    parameters defines a function with an empty parameter list"): its arguments are ``{}``."""
    params = function.get("parameters")
    if isinstance(params, dict):
        return params
    return {"type": "object", "properties": {}, "additionalProperties": False}


def constraint(body, chat: bool) -> tuple[pb.StructuredOutputs | None, Any]:
    """The body's constraint (None: free text) and, for chat, its tool mode (see ``_tool_schema``)."""
    backend = body.guided_decoding_backend or ""
    found: list[tuple[str, pb.StructuredOutputs]] = []
    if body.response_format is not None:
        msg = _response_format(body.response_format)
        if msg is not None:
            found.append(("response_format", msg))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs, backend)))
    for param in GUIDED:
        value = getattr(body, param)
        if value is not None:
            found.append((param, _one(param.removeprefix("guided_"), value, param, backend)))
    mode = None
    if chat:
        tool_msg, mode = _tool_schema(body)
        if tool_msg is not None:
            found.append(("tool_choice", tool_msg))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise HttpError(400, f"give one structured-output constraint, not several ({names})", found[1][0])
    if not found:
        return None, None
    msg = found[0][1]
    if backend and not msg.backend:
        msg.backend = backend
    return msg, mode
