"""Structured outputs end to end over gRPC (``GenerateRequest.structured``) on the embedded
model, whose free text is Austen-like words: every output that ends validates against its
JSON Schema, matches its regex, is one of its choices or parses with its grammar, so validity
comes from the constraint. Also: n > 1 with logprobs, stop strings, max_tokens truncation,
ignore_eos, the bitmask protocol (inline, and after the previous step's fold while steps
overlap), nothing per step for unconstrained requests, compile errors as INVALID_ARGUMENT (not
counted as abandoned streams), and a 1 MB schema compiling beside a stream. Other set-ups:
``test_structured_serving``."""

from __future__ import annotations

import contextlib
import json
import re
import time

import grpc
import jsonschema
import pytest

from headrace.controlplane.structured import backends
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion

pytestmark = pytest.mark.skipif(not any(backends.installed(n) for n in ("guidance", "xgrammar")),
                                reason="no grammar engine installed")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["proud", "prejudiced", "amiable"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["mood", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "guest": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 8},
                                                   "married": {"type": "boolean"}},
                  "required": ["first", "married"], "additionalProperties": False},
        "income": {"type": "integer", "minimum": 0, "maximum": 10000}},
     "required": ["guest", "income"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["ok", "note"], "additionalProperties": False},
]
SAMPLED = pb.SamplingParams(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def planes():
    planes = Planes(default_model_dir(), num_kv_blocks=256)
    yield planes
    planes.close()


def structured(**kind) -> pb.StructuredOutputs:
    return pb.StructuredOutputs(**kind)


@contextlib.contextmanager
def recording(planes):
    """Every StepRequest the engine sends to its workers while inside, in a list. A request
    ends before the steps sent after its last token are answered, and the bitmasks of those
    follow them: the recording starts and ends with no step in flight."""
    sent, workers = [], planes.engine.workers
    real = workers.send

    async def record(msg):
        sent.append(msg)
        return await real(msg)

    def settled():
        deadline = time.monotonic() + 10
        while len(planes.engine._inflight) and time.monotonic() < deadline:
            time.sleep(0.005)

    settled()
    workers.send = record
    try:
        yield sent
    finally:
        settled()
        workers.send = real


def run(planes, **fields):
    return completion(planes.generate(prompt="It is a truth universally acknowledged", **fields))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_against_its_schema(planes, index):
    schema = SCHEMAS[index]
    for seed in range(3):
        ids, text, finish = run(planes, max_tokens=120, sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                                structured=structured(json_schema=json.dumps(schema)))
        assert finish == pb.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), schema)


def test_free_text_is_not_json(planes):
    """The control: the same prompt unconstrained does not give JSON."""
    _, text, _ = run(planes, max_tokens=40, sampling=SAMPLED)
    with pytest.raises(ValueError):
        json.loads(text)


def test_regex_choice_grammar_and_json_object(planes):
    _, text, finish = run(planes, max_tokens=60, sampling=SAMPLED,
                          structured=structured(regex=r"[A-Z][a-z]{2,8}, [0-9]{1,2} (May|June) 18[0-9]{2}"))
    assert finish == pb.FINISH_REASON_STOP and re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{1,2} (May|June) 18[0-9]{2}", text)
    choices = ["Elizabeth", "Mr. Darcy", "Lady Catherine de Bourgh"]
    for seed in range(4):
        _, text, finish = run(planes, max_tokens=20, sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                              structured=structured(choice=pb.ChoiceList(choices=choices)))
        assert finish == pb.FINISH_REASON_STOP and text in choices
    grammar = 'root ::= "(" item (" " item){1,3} ")"\nitem ::= [a-z]{1,5} | [0-9]'
    _, text, finish = run(planes, max_tokens=40, sampling=SAMPLED, structured=structured(grammar=grammar))
    assert finish == pb.FINISH_REASON_STOP and re.fullmatch(r"\((?:[a-z]{1,5}|[0-9])(?: (?:[a-z]{1,5}|[0-9])){1,3}\)", text)
    _, text, finish = run(planes, max_tokens=200, sampling=SAMPLED, structured=structured(json_object=True))
    assert finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert text.startswith("{")
    if finish == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(text), dict)


def test_n_samples_each_have_a_matcher_and_logprobs(planes):
    schema = SCHEMAS[1]
    responses = planes.generate(prompt="Mr. Bennet", max_tokens=80, n=3, logprobs=2, sampling=SAMPLED,
                                structured=structured(json_schema=json.dumps(schema)))
    by_index: dict[int, list] = {}
    for r in responses:
        by_index.setdefault(r.index, []).append(r)
    assert sorted(by_index) == [0, 1, 2]
    for msgs in by_index.values():
        ids, text, finish = completion(msgs)
        assert finish == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), schema)
        lps = [lp for m in msgs for lp in m.logprobs]
        assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 2 for lp in lps)


def test_stop_strings_and_max_tokens(planes):
    regex = r"(ab){5}c(de){5}"
    _, text, finish = run(planes, max_tokens=40, sampling=SAMPLED, stop=["c"], structured=structured(regex=regex))
    assert finish == pb.FINISH_REASON_STOP_STRING and text == "ab" * 5
    ids, text, finish = run(planes, max_tokens=3, sampling=SAMPLED, structured=structured(regex=regex))
    assert finish == pb.FINISH_REASON_LENGTH and len(ids) == 3 and ("ab" * 5).startswith(text)


def test_ignore_eos_ends_where_the_grammar_does(planes):
    ids, text, finish = run(planes, max_tokens=30, ignore_eos=True, sampling=SAMPLED,
                            structured=structured(choice=pb.ChoiceList(choices=["yes", "no"])))
    assert finish == pb.FINISH_REASON_STOP and text in ("yes", "no") and ids[-1] == 1


def test_greedy_constrained_output_is_reproducible(planes):
    fields = dict(max_tokens=60, sampling=pb.SamplingParams(temperature=0), structured=structured(
        json_schema=json.dumps(SCHEMAS[0])))
    assert run(planes, **fields) == run(planes, **fields)


def test_bitmasks_ride_the_steps_inline_and_after_the_fold(planes):
    """Steps overlap (a step is sent before the one before it is answered): a decode's
    bitmask needs its previous token, so it follows the fold (late_bitmask) and the worker
    samples after it; the first token's comes inline. Unconstrained steps carry none."""
    with recording(planes) as sent:
        run(planes, max_tokens=12, sampling=SAMPLED)
        assert sent and not any(m.HasField("bitmask") or m.bitmask_follows or m.late_bitmask for m in sent)
        sent.clear()
        _, text, finish = run(planes, max_tokens=60, sampling=SAMPLED,
                              structured=structured(json_schema=json.dumps(SCHEMAS[0])))
        jsonschema.validate(json.loads(text), SCHEMAS[0])
    follows = [m.step_id for m in sent if m.bitmask_follows]
    late = [m.step_id for m in sent if m.late_bitmask]
    assert follows and late == follows   # each promised bitmask came, in order
    assert any(m.HasField("bitmask") and not m.late_bitmask for m in sent)   # the first token's
    for i, m in enumerate(sent):
        if m.bitmask_follows:   # a later message completes it, one step at most sent between
            until = next(j for j, n in enumerate(sent) if n.late_bitmask and n.step_id == m.step_id)
            assert sum(not n.late_bitmask for n in sent[i + 1:until]) <= 1, (i, sent)
    assert planes.engine.structured.live == 0 and planes.engine.structured.num_rejected == 0


def _abandoned(planes) -> float:
    registry = planes.engine.telemetry.metrics.registry
    return sum(registry.get_sample_value("headrace:request_abandoned_total", {"reason": r}) or 0.0
               for r in ("client_cancel", "deadline", "disconnect", "server_abort"))


def test_compile_errors_are_invalid_argument(planes):
    abandoned = _abandoned(planes)
    for bad, words in ((structured(regex="(unclosed"), "regex does not compile"),
                       (structured(json_schema='{"type": "frobnicate"}'), "json_schema does not compile"),
                       (structured(json_schema="{oops"), "not valid JSON"),
                       (structured(grammar="root ::= nowhere"), "grammar"),
                       (structured(regex="a", backend="outlines"), "backend 'outlines'")):
        with pytest.raises(grpc.RpcError) as info:
            run(planes, max_tokens=5, structured=bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    assert not planes.engine.requests and _abandoned(planes) == abandoned   # refused, not abandoned
    _, _, finish = run(planes, max_tokens=5, structured=structured(regex="[a-z]+"))   # still serving
    assert finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def test_a_large_schema_compiles_beside_a_stream(planes):
    """A ~1 MB schema (compiling for about a second here) does not hold up another client's
    stream: its TTFT stays near the one measured alone (a generous bound)."""
    def ttft() -> float:
        start = time.perf_counter()
        stream = planes.stub.Generate(pb.GenerateRequest(prompt="Netherfield", max_tokens=4), timeout=60)
        next(iter(stream))
        first = time.perf_counter() - start
        list(stream)
        return first

    alone = min(ttft() for _ in range(3))
    salt = str(time.time())   # never compiled before (no cache hit)
    schema = {"type": "object", "additionalProperties": False, "description": salt,
              "properties": {f"f{i}": {"type": "integer", "description": "x" * 500} for i in range(2000)}}
    call = planes.stub.Generate(pb.GenerateRequest(prompt="A", max_tokens=8, structured=structured(
        json_schema=json.dumps(schema))), timeout=120)
    time.sleep(0.05)   # its compilation has begun
    during = ttft()
    assert during < 3 * alone + 0.4, (during, alone)
    responses = list(call)   # and it is served once compiled
    assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
