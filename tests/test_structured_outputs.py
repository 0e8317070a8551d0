"""Structured outputs end to end over gRPC (``GenerateRequest.structured``) on the embedded
model, whose free text is Austen-like words: every output that ends validates against its
JSON Schema, matches its regex, is one of its choices or parses with its grammar, so validity
comes from the constraint. Also: n > 1 with logprobs, stop strings, max_tokens truncation,
preemption in a tight KV pool, the split engine core, the bitmask protocol (inline, and after
the previous step's fold while steps overlap), nothing per step for unconstrained requests,
compile errors as INVALID_ARGUMENT, and a 1 MB schema compiling beside a stream."""

from __future__ import annotations

import json
import re
import time

import grpc
import jsonschema
import pytest

from controlplane.structured import backends
from dataplane.default_model import default_model_dir
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
    sent = []
    workers = planes.engine.workers
    real = workers.send

    async def record(msg):
        sent.append(msg)
        return await real(msg)

    workers.send = record
    try:
        run(planes, max_tokens=12, sampling=SAMPLED)
        assert sent and not any(m.HasField("bitmask") or m.bitmask_follows or m.late_bitmask for m in sent)
        sent.clear()
        _, text, finish = run(planes, max_tokens=60, sampling=SAMPLED,
                              structured=structured(json_schema=json.dumps(SCHEMAS[0])))
        jsonschema.validate(json.loads(text), SCHEMAS[0])
    finally:
        workers.send = real
    follows = [m.step_id for m in sent if m.bitmask_follows]
    late = [m.step_id for m in sent if m.late_bitmask]
    assert follows and late == follows   # each promised bitmask came, in order
    assert any(m.HasField("bitmask") and not m.late_bitmask for m in sent)   # the first token's
    for i, m in enumerate(sent):
        if m.bitmask_follows:   # the next message of the stream completes it
            assert sent[i + 1].late_bitmask and sent[i + 1].step_id == m.step_id
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


def test_preemption_keeps_the_matcher():
    """A KV pool too small for the batch preempts sequences (recompute); each resumes with the
    matcher that consumed its tokens, so every output still matches."""
    planes = Planes(default_model_dir(), num_kv_blocks=20, block_size=16)
    regex = r"[a-z]{1,7}( [a-z]{1,7}){50,60}\."
    try:
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda s: run(planes, max_tokens=250, sampling=pb.SamplingParams(
                temperature=1.0, seed=s), structured=structured(regex=regex)), range(6)))
        assert planes.engine.scheduler.num_preemptions > 0
        for _, text, finish in outs:
            assert finish == pb.FINISH_REASON_STOP and re.fullmatch(regex, text), text
    finally:
        planes.close()


def test_the_split_engine_core_constrains_too():
    planes = Planes(default_model_dir(), split=True)
    try:
        _, text, finish = run(planes, max_tokens=120, sampling=SAMPLED,
                              structured=structured(json_schema=json.dumps(SCHEMAS[2])))
        assert finish == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), SCHEMAS[2])
        with pytest.raises(grpc.RpcError) as info:
            run(planes, max_tokens=5, structured=structured(regex="(x"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in info.value.details()
    finally:
        planes.close()


def test_the_client_library_sends_constraints(planes):
    from headrace_client import Client, InvalidRequest
    from headrace_client.types import build_request

    with Client(planes.address) as client:
        out = client.generate("Jane", max_tokens=120, temperature=1.0, seed=3, json_schema=SCHEMAS[0])
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[0])
        chunks = list(client.stream("Jane", max_tokens=20, choice=["Longbourn", "Pemberley"]))
        assert "".join(c.text for c in chunks) in ("Longbourn", "Pemberley")
        with pytest.raises(InvalidRequest, match="regex does not compile"):
            client.generate("Jane", max_tokens=5, regex="([a-z]")
    assert build_request("x", regex="a+", structured_backend="guidance").structured.backend == "guidance"
    assert build_request("x", json_object=True).structured.json_object
    assert not build_request("x").HasField("structured")
    with pytest.raises(TypeError, match="not regex, grammar"):
        build_request("x", regex="a", grammar="root ::= \"a\"")


def _planes_with(**options):
    from controlplane.engine import EngineConfig

    worker = options.pop("worker_fields", None)
    return Planes(default_model_dir(), config=EngineConfig(**options), worker_fields=worker)


@pytest.mark.parametrize("options", [
    dict(pipeline_depth=1),                                      # --no-overlap: every bitmask inline
    dict(structured_outputs_backend="xgrammar"),
    dict(worker_fields={"speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})}),
], ids=["no-overlap", "xgrammar", "ngram-speculation"])
def test_other_configurations_constrain_too(options):
    if options.get("structured_outputs_backend") == "xgrammar" and not backends.installed("xgrammar"):
        pytest.skip("xgrammar is not installed")
    planes = _planes_with(**options)
    sent = []
    real = planes.engine.workers.send

    async def record(msg):
        sent.append(msg)
        return await real(msg)

    planes.engine.workers.send = record
    try:
        # a repetitive prompt: n-gram lookups find drafts for the unconstrained request
        free = planes.call(_both(planes, "the the the the the the the the the", SCHEMAS[1]))
        text, finish = free
        assert finish == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), SCHEMAS[1])
        _, text, finish = run(planes, max_tokens=40, sampling=SAMPLED, structured=structured(
            grammar='root ::= "(" [a-z]{1,4} (" " [a-z]{1,4}){1,3} ")"'))
        assert finish == pb.FINISH_REASON_STOP and re.fullmatch(r"\([a-z]{1,4}( [a-z]{1,4}){1,3}\)", text)
    finally:
        planes.engine.workers.send = real
        planes.close()
    if options.get("pipeline_depth") == 1:
        assert not any(m.bitmask_follows for m in sent) and any(m.HasField("bitmask") for m in sent)
    if "worker_fields" in options:   # the unconstrained request speculated; the constrained did not
        spec = planes.engine.scheduler.speculation
        assert spec.num_drafts > 0 and planes.engine.structured.num_rejected == 0


async def _both(planes, prompt: str, schema: dict):
    """A free-text request beside a constrained one, on the engine directly; the latter's text."""
    import asyncio

    from headrace.v1 import inference_pb2 as pbm

    async def one(req):
        out, finish = [], 0
        async for msg in planes.plane.requests.generate(req):
            out.append(msg.text)
            finish = msg.finish_reason or finish
        return "".join(out), finish

    free = pbm.GenerateRequest(prompt=prompt, max_tokens=40, sampling=pbm.SamplingParams(temperature=0))
    constrained = pbm.GenerateRequest(prompt=prompt, max_tokens=80, sampling=pbm.SamplingParams(temperature=0),
                                      structured=pbm.StructuredOutputs(json_schema=json.dumps(schema)))
    _, result = await asyncio.gather(one(free), one(constrained))
    return result


def test_headrace_generate_takes_a_constraint(planes, tmp_path):
    from tests.test_cli_failures import _headrace

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    base = ("generate", "Jane", "--address", planes.address, "--max-tokens", "80", "--seed", "1")
    out = _headrace(*base, "--json-schema", f"@{schema}")
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), SCHEMAS[0])
    out = _headrace(*base, "--choice", "Kitty", "--choice", "Lydia")
    assert out.returncode == 0 and out.stdout.strip() in ("Kitty", "Lydia")
    out = _headrace(*base, "--regex", "(x")
    assert out.returncode == 1 and "regex does not compile" in out.stderr
    out = _headrace(*base, "--regex", "a", "--choice", "b")
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_a_named_backend_that_is_missing_stops_the_command(monkeypatch):
    import argparse

    from cli.options import check_structured_outputs_backend

    monkeypatch.setattr(backends, "installed", lambda name: False)
    with pytest.raises(SystemExit, match=r"xgrammar is not installed; pip install 'headrace\[xgrammar\]'"):
        check_structured_outputs_backend(argparse.Namespace(structured_outputs_backend="xgrammar"))
    check_structured_outputs_backend(argparse.Namespace(structured_outputs_backend="auto"))   # no error
