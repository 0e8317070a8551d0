"""The llguidance grammar engine (``--structured-outputs-backend guidance``): Rust, no torch.

A constraint becomes an llguidance grammar (JSON Schema, regex, Lark; GBNF is translated to
Lark by llguidance's own converter; a choice list is a Lark alternation of string literals);
compiling it is building one ``LLMatcher`` in its initial state (llguidance drops the GIL
while it builds the grammar), which every sequence of the grammar then copies
(``deep_copy``). Masks are computed straight into the caller's numpy row.

Lanes: a ``deep_copy`` shares its template's lexer state (one ``Arc<Mutex<SharedState>>`` in
llguidance's parser), and a mask is computed under that mutex, so the masks of every sequence
copied from one template are computed one at a time whatever the executor's threads (64 rows
of the bench's schema: 0.80 ms on one thread, 0.78 on two; with independent states 1.06 and
0.55, on this repository's 2-core machine). A grammar used by more than one sequence is
therefore built again into one independent template per executor thread ("lanes"), off the
loop and after the first, each sequence copies the next lane in turn, and a step's rows are
handed to the executor ordered by lane. On the H200's 16-core host (12 threads) 64 rows took
0.38-0.43 ms with 12 lanes against 0.96-1.05 ms copied from one; 24 or 48 lanes (2 or 4 a
thread) measured the same as 12 (``bench/mask_fill_bench.py --lanes-per-thread``)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pathlib

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from headrace.controlplane.structured.spec import Constraint, ConstraintError

log = logging.getLogger("headrace.structured")
LANES_PER_THREAD = 1

JSON_OBJECT = '{"type": "object"}'
# JSON without free whitespace: '{"a": 1, "b": [2, 3]}' (xgrammar's any_whitespace=False too).
# Free whitespace lets a model pad a value with blank lines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked)."""
    kind, text = constraint.kind, constraint.text
    matcher = llguidance.LLMatcher
    if kind == "json":
        return matcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "choice":   # JSON string literals are Lark's too
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
    if "::=" in text:      # GBNF / EBNF
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter's own errors: the user's grammar
            raise ConstraintError(f"structured: grammar: {exc}") from None
    return matcher.grammar_from_lark(text)


def eos_row(eos: list[int], vocab_size: int) -> np.ndarray:
    """A bitmask allowing only the EOS tokens."""
    bits = np.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    bits[eos] = True
    return np.packbits(bits, bitorder="little").view("<i4")


def executor_threads() -> int:
    """llguidance's own default for its executor: 80% of the cores this process may use, 1-32."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(max(cores * 80 // 100, 1), 32)


class GuidanceMatcher:
    __slots__ = ("_m", "_eos", "lane")

    def __init__(self, m: llguidance.LLMatcher, eos: np.ndarray, lane: int = 0):
        self._m, self._eos, self.lane = m, eos, lane

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def fill(self, row: np.ndarray) -> None:
        if self._m.is_error():   # nothing is valid any more: let it end
            row[:] = self._eos
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    @property
    def finished(self) -> bool:
        return self._m.is_stopped()


class GuidanceCompiled:
    """A compiled grammar: its lanes (independent templates, the first built by ``compile``,
    the others once a second sequence asks for a matcher) hand out matchers in turn."""

    def __init__(self, backend: "GuidanceBackend", grammar: str, template: llguidance.LLMatcher):
        self._backend, self._grammar = backend, grammar
        self.lanes = [template]   # appended to by the lane builder's thread
        self._handed = 0

    def matcher(self) -> GuidanceMatcher:
        lane = self._handed % len(self.lanes)
        self._handed += 1
        if self._handed == 2:   # more than one sequence uses it: build the other lanes
            self._backend.build_lanes(self)
        return GuidanceMatcher(self.lanes[lane].deep_copy(), self._backend.eos_row, lane)

    def add_lanes(self, count: int) -> None:
        """Builds ``count`` more lanes (on the lane builder's thread; llguidance releases the
        GIL while it builds)."""
        for _ in range(count):
            lane = llguidance.LLMatcher(self._backend.tokenizer, self._grammar, log_level=0)
            if lane.is_error():   # (it compiled once: not expected)
                log.warning("structured: a lane failed to build: %s", lane.get_error().strip())
                return
            self.lanes.append(lane)


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer_file: pathlib.Path, vocab_size: int, eos_token_ids: list[int],
                 threads: int | None = None, lanes_per_thread: int = LANES_PER_THREAD):
        self.vocab_size = vocab_size
        self.eos = [t for t in eos_token_ids if t < vocab_size]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size,
                                                eos_token=self.eos or None)
        self.eos_row = eos_row(self.eos, vocab_size)
        self.threads = threads or executor_threads()
        self.num_lanes = self.threads * lanes_per_thread
        self._executor = llguidance.LLExecutor(self.threads)   # fills in parallel, GIL released
        self._lane_builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-grammar-lanes")

    def build_lanes(self, compiled: GuidanceCompiled) -> None:
        """``LANES_PER_THREAD`` lanes per executor thread for ``compiled``, built in the
        background (the loop never waits: matchers handed out meanwhile share the lanes built so
        far). Each lane holds its own lexer cache: a grammar's memory grows with its lanes."""
        if self.num_lanes > len(compiled.lanes):
            self._lane_builder.submit(compiled.add_lanes, self.num_lanes - len(compiled.lanes))

    def fill_rows(self, matchers: list[GuidanceMatcher], rows: np.ndarray, indexes: list[int]) -> None:
        """Each matcher's mask into ``rows[indexes[i]]`` (one call for the whole step)."""
        if len(matchers) == 1:
            matchers[0].fill(rows[indexes[0]])
            return
        pairs = []
        for m, i in sorted(zip(matchers, indexes), key=lambda pair: pair[0].lane):
            if m._m.is_error():
                rows[i] = self.eos_row
            else:
                pairs.append((m._m, i))
        if pairs:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, rows)

    def compile(self, constraint: Constraint) -> GuidanceCompiled:
        grammar = grammar_of(constraint)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(f"structured: {_field(constraint)} does not compile: "
                                  f"{template.get_error().strip()}")
        return GuidanceCompiled(self, grammar, template)


def _field(constraint: Constraint) -> str:
    return {"json": "json_schema"}.get(constraint.kind, constraint.kind)
