"""Structured outputs in other set-ups than the default engine: preemption in a tight KV pool,
the split engine core, --no-overlap, the xgrammar backend, beside n-gram speculation, the client
library, ``headrace generate``'s flags and a missing backend at start (the default engine's
tests are ``test_structured_outputs``)."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from headrace.controlplane.structured import backends
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes
from tests.test_structured_outputs import (SAMPLED, SCHEMAS, planes, recording, run,  # noqa: F401
                                           structured)

pytestmark = pytest.mark.skipif(not any(backends.installed(n) for n in ("guidance", "xgrammar")),
                                reason="no grammar engine installed")


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
    from headrace.client import Client, InvalidRequest
    from headrace.client.types import build_request

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
    from headrace.controlplane.engine.loop import EngineConfig

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
    try:
        with recording(planes) as sent:
            # a repetitive prompt: n-gram lookups find drafts for the unconstrained request
            text, finish = planes.call(_both(planes, "the the the the the the the the the", SCHEMAS[1]))
            assert finish == pb.FINISH_REASON_STOP
            jsonschema.validate(json.loads(text), SCHEMAS[1])
            _, text, finish = run(planes, max_tokens=40, sampling=SAMPLED, structured=structured(
                grammar='root ::= "(" [a-z]{1,4} (" " [a-z]{1,4}){1,3} ")"'))
            assert finish == pb.FINISH_REASON_STOP and re.fullmatch(r"\([a-z]{1,4}( [a-z]{1,4}){1,3}\)", text)
    finally:
        planes.close()
    if options.get("pipeline_depth") == 1:
        assert not any(m.bitmask_follows for m in sent) and any(m.HasField("bitmask") for m in sent)
    if "worker_fields" in options:   # the unconstrained request speculated
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

    from headrace.cli.configs import check_structured_outputs_backend

    monkeypatch.setattr(backends, "installed", lambda name: False)
    with pytest.raises(SystemExit, match=r"xgrammar is not installed; pip install 'headrace\[xgrammar\]'"):
        check_structured_outputs_backend(argparse.Namespace(structured_outputs_backend="xgrammar"))
    check_structured_outputs_backend(argparse.Namespace(structured_outputs_backend="auto"))   # no error


def test_ngram_drafts_of_a_constrained_request_are_checked_and_accepted():
    """A repetitive constrained output under n-gram speculation: the control plane proposes
    the drafts, cuts them where the grammar would reject one, and ships a bitmask per verified
    position; the worker verifies exactly those, so drafts are accepted and the output matches."""
    planes = _planes_with(worker_fields={"speculative_config": json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})})
    try:
        with recording(planes) as sent:
            regex = "(la ){12}fin"
            _, text, finish = run(planes, max_tokens=60, sampling=pb.SamplingParams(temperature=0),
                                  structured=structured(regex=regex))
            assert finish == pb.FINISH_REASON_STOP and re.fullmatch(regex, text), text
            assert planes.engine.scheduler.speculation.num_accepted_tokens > 0
    finally:
        planes.close()
    checked = [m for m in sent if m.checked_draft_seq_ids]
    assert checked and all(len(m.bitmask.seq_ids) == len(m.checked_draft_seq_ids) + sum(m.checked_draft_counts)
                           for m in checked)
