"""The grammar engines behind structured outputs (``headrace.controlplane.structured``): both
backends compile every kind of constraint for the embedded model's tokenizer into matchers whose
masks allow exactly the texts the constraint does, EOS only where the output is complete; bad
constraints fail with a message naming the problem; the compile pool caches by text and never runs
on the caller's thread; the front end's cheap checks (``spec``)."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.controlplane.structured import backends, spec
from headrace.controlplane.structured.compiler import GrammarCompiler
from headrace.controlplane.structured.spec import Constraint, ConstraintError
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb

MODEL = default_model_dir()
VOCAB, EOS = 2048, 1
NAMES = [n for n in ("guidance", "xgrammar") if backends.installed(n)]


@pytest.fixture(scope="module", params=NAMES)
def backend(request):
    return backends.load(request.param, MODEL, VOCAB, [EOS])


@pytest.fixture(scope="module")
def tokenizer():
    return ModelTokenizer(MODEL)


def allowed(matcher) -> set[int]:
    row = np.zeros(backends.bitmask_words(VOCAB), dtype=np.int32)
    matcher.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def walk(matcher, ids: list[int]) -> bool:
    """Feeds ``ids`` checking each against the mask first; True when all were allowed."""
    for t in ids:
        if t not in allowed(matcher) or not matcher.accept(t):
            return False
    return True


@pytest.mark.parametrize("constraint,good,bad", [
    (Constraint("regex", r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-ab"),
    (Constraint("choice", json.dumps(["Elizabeth", "Mr. Darcy", 'say "hi" \\ now', "ünï"])),
     'say "hi" \\ now', "Elizabeth Bennet"),
    (Constraint("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"], "additionalProperties": False})),
     '{"a": 12}', '{"b": 1}'),
    (Constraint("json_object", ""), '{"x": [1, "y"]}', '[1, 2]'),
    (Constraint("grammar", 'root ::= "yes" | "no" " " root'), "no no yes", "no yes no"),
])
def test_masks_allow_exactly_the_constrained_texts(backend, tokenizer, constraint, good, bad):
    compiled = backend.compile(constraint)
    m = compiled.matcher()
    assert EOS not in allowed(m)   # nothing is complete yet
    assert walk(m, tokenizer.encode(good, add_special_tokens=False)), good
    assert EOS in allowed(m)       # complete: EOS allowed (and it ends the grammar)
    assert m.accept(EOS) and m.finished
    m2 = compiled.matcher()        # a new matcher of the same grammar starts afresh
    assert not walk(m2, tokenizer.encode(bad, add_special_tokens=False)) or EOS not in allowed(m2)


def test_lark_grammars_with_guidance(tokenizer):
    if "guidance" not in NAMES:
        pytest.skip("llguidance is not installed")
    m = backends.load("guidance", MODEL, VOCAB, [EOS]).compile(
        Constraint("grammar", 'start: "a"+ "b"')).matcher()
    assert walk(m, tokenizer.encode("aaab", add_special_tokens=False)) and EOS in allowed(m)


def test_rollback_restores_the_state(backend, tokenizer):
    m = backend.compile(Constraint("regex", "(ab)+")).matcher()
    before = allowed(m)
    ids = tokenizer.encode("abab", add_special_tokens=False)
    assert walk(m, ids)
    m.rollback(len(ids))
    assert allowed(m) == before


@pytest.mark.parametrize("constraint,words", [
    (Constraint("regex", "(abc"), "regex"),
    (Constraint("json", '{"type": "frobnicate"}'), "json_schema"),
    (Constraint("grammar", "root ::= undefined_rule"), "grammar"),
])
def test_a_bad_constraint_names_the_problem(backend, constraint, words):
    with pytest.raises(ConstraintError, match=words) as info:
        backend.compile(constraint)
    assert str(info.value).startswith("structured: ")


def test_fill_rows_fills_each_matchers_row_and_leaves_the_rest(backend):
    ms = [backend.compile(Constraint("regex", "[0-9]+")).matcher(),
          backend.compile(Constraint("json_object", "")).matcher()]
    rows = np.full((3, backends.bitmask_words(VOCAB)), -1, dtype=np.int32)
    backend.fill_rows(ms, rows, [0, 2])
    counts = [int(np.unpackbits(r.view(np.uint8)).sum()) for r in rows]
    assert counts[0] == 10 and counts[1] == VOCAB and counts[2] == 1   # digits; untouched; '{'


def test_guidance_builds_a_lane_per_executor_thread_once_a_grammar_is_shared(tokenizer):
    """A ``deep_copy`` shares its template's lexer mutex (masks of copies are computed one at
    a time): a grammar a second sequence uses gets an independent template per thread, the
    matchers go round them, and every lane's masks are the grammar's."""
    if "guidance" not in NAMES:
        pytest.skip("llguidance is not installed")
    from headrace.controlplane.structured.guidance import GuidanceBackend

    b = GuidanceBackend(pathlib.Path(MODEL) / "tokenizer.json", VOCAB, [EOS], threads=3)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    compiled = b.compile(Constraint("json", json.dumps(schema)))
    ms = [compiled.matcher()]
    time.sleep(0.05)
    assert len(compiled.lanes) == 1          # one sequence: nothing more is built
    ms.append(compiled.matcher())
    deadline = time.monotonic() + 30
    while len(compiled.lanes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(compiled.lanes) == 3 and len({id(lane) for lane in compiled.lanes}) == 3
    ms += [compiled.matcher() for _ in range(4)]
    assert {m.lane for m in ms[2:]} == {0, 1, 2}
    text = tokenizer.encode('{"name": "Eliza', add_special_tokens=False)
    for i, m in enumerate(ms):                # each walks a prefix of its own length
        assert walk(m, text[:i % len(text)])
    rows = np.zeros((len(ms), backends.bitmask_words(VOCAB)), dtype=np.int32)
    b.fill_rows(ms, rows, list(range(len(ms))))
    reference = backends.load("guidance", MODEL, VOCAB, [EOS]).compile(Constraint("json", json.dumps(schema)))
    for i, m in enumerate(ms):
        alone = reference.matcher()
        assert walk(alone, text[:i % len(text)])
        assert allowed(alone) == set(np.flatnonzero(np.unpackbits(
            rows[i].view(np.uint8), bitorder="little")[:VOCAB]).tolist()), i


@settings(max_examples=25, deadline=None)
@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1,
                        max_size=8), min_size=1, max_size=5, unique=True))
def test_a_choice_allows_each_of_its_strings(choices):
    """Any strings (quotes, backslashes, unicode) make a choice grammar that accepts each: the
    grammar takes the tokenizer's own ids, and its masks let a sampler spell every string.
    (Not necessarily in the tokenizer's ids: llguidance >= 1.9 masks out some non-canonical
    splits, e.g. "'" then "s" after "¡" where the vocabulary holds "'s".)"""
    tok = ModelTokenizer(MODEL)
    token_bytes = _backend("guidance").tokenizer.decode_bytes
    for name in NAMES:
        compiled = _backend(name).compile(Constraint("choice", json.dumps(choices)))
        for c in choices:
            m = compiled.matcher()
            assert all(m.accept(t) for t in tok.encode(c, add_special_tokens=False)), (name, c)
            assert spells(compiled, token_bytes, c.encode()), (name, c)


def spells(compiled, token_bytes, rest: bytes, ids: tuple[int, ...] = ()) -> bool:
    """Whether tokens each allowed by the mask before it spell ``rest`` after ``ids`` (depth
    first, longest token first)."""
    if not rest:
        return True
    m = compiled.matcher()
    for t in ids:
        m.accept(t)
    fits = [(len(b), t) for t in allowed(m) if (b := token_bytes([t])) and rest.startswith(b)]
    return any(spells(compiled, token_bytes, rest[n:], ids + (t,)) for n, t in sorted(fits, reverse=True))


_LOADED: dict = {}


def _backend(name):
    if name not in _LOADED:
        _LOADED[name] = backends.load(name, MODEL, VOCAB, [EOS])
    return _LOADED[name]


# -- spec: the front end's checks ---------------------------------------------------------------
@pytest.mark.parametrize("msg,error", [
    (pb.StructuredOutputs(json_schema="{not json"), "json_schema is not valid JSON"),
    (pb.StructuredOutputs(json_schema="[1]"), "must be a JSON object"),
    (pb.StructuredOutputs(choice=pb.ChoiceList()), "at least one"),
    (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["a", ""])), "must not be empty"),
    (pb.StructuredOutputs(regex="   "), "regex must not be empty"),
    (pb.StructuredOutputs(backend="xgrammar"), "no constraint"),
    (pb.StructuredOutputs(json_schema=json.dumps({"d": "x" * (spec.MAX_CONSTRAINT_BYTES)})), "longer than"),
])
def test_spec_refuses_what_cannot_be_a_constraint(msg, error):
    with pytest.raises(ConstraintError, match=error):
        spec.from_proto(msg)


def test_spec_round_trips_and_keys():
    for msg in (pb.StructuredOutputs(json_schema='{"type": "integer"}'), pb.StructuredOutputs(regex="a+"),
                pb.StructuredOutputs(choice=pb.ChoiceList(choices=["x", "y"])),
                pb.StructuredOutputs(grammar='root ::= "a"', backend="guidance"),
                pb.StructuredOutputs(json_object=True)):
        c = spec.from_proto(msg)
        assert spec.from_proto(c.to_proto()) == c
    assert spec.from_proto(pb.StructuredOutputs()) is None
    assert spec.from_proto(pb.StructuredOutputs(regex="a", backend="auto")).backend == ""
    a, b = Constraint("regex", "a+"), Constraint("grammar", "a+")
    assert a.key("guidance", "t") != b.key("guidance", "t") != a.key("xgrammar", "t")
    assert a.key("guidance", "t") == Constraint("regex", "a+").key("guidance", "t")


# -- the compile pool ---------------------------------------------------------------------------
def test_compiler_caches_by_text_and_compiles_off_the_callers_thread():
    compiler = GrammarCompiler("auto")
    compiler.configure(str(MODEL), VOCAB, [EOS])
    threads = []
    real = compiler._compile
    compiler._compile = lambda c: (threads.append(threading.current_thread()), real(c))[1]
    c = Constraint("regex", "[a-z]{2,4}")
    first, same = compiler.compile(c), compiler.compile(Constraint("regex", "[a-z]{2,4}"))
    assert first is same   # concurrent requests share one compilation
    first.result(30)
    assert compiler.compile(c).done() and compiler.num_compiled == 1
    assert threads and threads[0] is not threading.current_thread()
    bad = compiler.compile(Constraint("regex", "(x"))
    assert isinstance(bad.exception(30), ConstraintError)
    assert compiler.compile(Constraint("regex", "(x")).exception(0) is bad.exception()   # cached
    assert compiler.num_compiled == 2
    compiler.configure(str(MODEL), VOCAB + 32, [EOS])   # another model: compiled afresh
    compiler.compile(c).result(30)
    assert compiler.num_compiled == 3
    compiler.shutdown()


def test_compiler_refuses_another_backend_and_a_missing_one(monkeypatch):
    compiler = GrammarCompiler("auto")
    compiler.configure(str(MODEL), VOCAB, [EOS])
    name = backends.resolve("auto")
    other = "xgrammar" if name == "guidance" else "guidance"
    exc = compiler.compile(Constraint("regex", "a", backend=other)).exception(0)
    assert isinstance(exc, ConstraintError) and "--structured-outputs-backend" in str(exc)
    monkeypatch.setattr(backends, "installed", lambda n: False)
    exc = compiler.compile(Constraint("regex", "a")).exception(0)
    assert isinstance(exc, backends.BackendUnavailable) and "pip install" in str(exc)
    with pytest.raises(backends.BackendUnavailable, match="headrace\\[xgrammar\\]"):
        backends.resolve("xgrammar")
    compiler.shutdown()


def test_a_large_schema_compiles_without_holding_the_gil():
    """A ~1 MB schema compiles in the pool while this thread keeps running (ticks no more
    than a generous gap apart)."""
    schema = json.dumps({"type": "object", "additionalProperties": False,
                         "properties": {f"f{i}": {"type": "integer", "description": "x" * 1000}
                                        for i in range(1000)}})
    assert len(schema) > 1_000_000
    compiler = GrammarCompiler("auto")
    compiler.configure(str(MODEL), VOCAB, [EOS])
    compiler.compile(Constraint("regex", "a")).result(30)   # the backend is loaded
    future = compiler.compile(Constraint("json", schema))
    gaps, last = [], time.perf_counter()
    while not future.done():
        time.sleep(0.002)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    future.result()
    assert len(gaps) > 5 and max(gaps) < 0.5, max(gaps)
    compiler.shutdown()


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(tokenizer):
    """Checked drafts (speculative decoding): a bitmask after each draft the grammar allows,
    none after the first it rejects; the matcher is left as it was."""
    import types

    from headrace.controlplane.requests.request import Status
    from headrace.controlplane.structured.outputs import StructuredOutputs

    outputs = StructuredOutputs("auto")
    outputs.configure(str(MODEL), VOCAB, [EOS])
    grammar = outputs.compiler.compile(Constraint("regex", "[0-9]{3}x")).result(30)
    seq = types.SimpleNamespace(seq_id=5, grammar=grammar.matcher(), status=Status.RUNNING)
    digit = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "12a3"]
    drafts = {5: digit}
    msg = outputs.bitmask([seq], drafts)
    assert list(msg.seq_ids) == [5, 5, 5] and drafts == {5: digit[:2]}   # '1', '2' kept; 'a' cut
    from headrace.dataplane.bitmasks import rows_of

    rows = rows_of(msg, VOCAB)
    for row in rows:   # each position allows digits only
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        assert bits[digit[0]] and bits[digit[3]] and not bits[digit[2]]
    assert allowed(seq.grammar) == allowed(grammar.matcher())   # rolled back
    outputs.compiler.shutdown()
