"""A request's structured-output constraint as the control plane keeps it: ``Constraint``
(its kind and its text) from the ``StructuredOutputs`` message, the cheap checks a front end
makes before anything is compiled, and the key grammars are cached by.

Kinds: ``json`` (a JSON Schema's text), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings; its text is the list as JSON) and ``grammar`` (GBNF /
EBNF, or Lark with the guidance backend). Whether a constraint compiles is the grammar engine's
to say (``headrace.controlplane.structured.compiler``); here only what needs no engine is checked."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from headrace.controlplane.requests.limits import MAX_CONSTRAINT_BYTES
from headrace.controlplane.requests.errors import ValidationError
from headrace.v1 import inference_pb2 as pb

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 4096


class ConstraintError(ValidationError):
    """A constraint that cannot be used: the message names the field and the problem
    (INVALID_ARGUMENT / HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str
    text: str           # the schema / regex / grammar; for choice, the JSON list of choices
    backend: str = ""   # the engine the request names ("" = the server's)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []

    def key(self, backend: str, tokenizer_id: str) -> str:
        """The compile cache's key: a hash of (backend, kind, text, tokenizer)."""
        h = hashlib.sha256()
        for part in (backend, self.kind, tokenizer_id, self.text):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()

    def to_proto(self) -> pb.StructuredOutputs:
        msg = pb.StructuredOutputs(backend=self.backend)
        if self.kind == "json":
            msg.json_schema = self.text
        elif self.kind == "json_object":
            msg.json_object = True
        elif self.kind == "regex":
            msg.regex = self.text
        elif self.kind == "choice":
            msg.choice.choices.extend(self.choices)
        else:
            msg.grammar = self.text
        return msg


def _fail(message: str) -> None:
    raise ConstraintError(f"structured: {message}")


def from_proto(msg: pb.StructuredOutputs) -> Constraint | None:
    """The request's constraint (None: free text), checked as far as it can be without a
    grammar engine; ConstraintError otherwise."""
    which = msg.WhichOneof("constraint")
    if which is None:
        if msg.backend and msg.backend != "auto":
            _fail("backend is set but no constraint (json_schema, regex, choice, grammar, json_object)")
        return None
    backend = "" if msg.backend == "auto" else msg.backend
    if which == "json_object":
        if not msg.json_object:
            _fail("json_object must be true when it is the constraint")
        return Constraint("json_object", "", backend)
    if which == "choice":
        choices = list(msg.choice.choices)
        if not choices:
            _fail("choice must list at least one string")
        if len(choices) > MAX_CHOICES:
            _fail(f"choice: at most {MAX_CHOICES} strings")
        if any(c == "" for c in choices):
            _fail("choice: the strings must not be empty")
        text = json.dumps(choices, ensure_ascii=False)
        _check_size("choice", text)
        return Constraint("choice", text, backend)
    text = getattr(msg, which)
    kind = "json" if which == "json_schema" else which
    _check_size(which, text)
    if not text.strip():
        _fail(f"{which} must not be empty")
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            _fail(f"json_schema is not valid JSON: {exc}")
        if not isinstance(schema, (dict, bool)):
            _fail("json_schema must be a JSON object (a JSON Schema)")
    return Constraint(kind, text, backend)


def _check_size(field: str, text: str) -> None:
    if len(text) * 4 <= MAX_CONSTRAINT_BYTES:
        return
    if len(text) > MAX_CONSTRAINT_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        _fail(f"{field} is longer than {MAX_CONSTRAINT_BYTES} bytes")
