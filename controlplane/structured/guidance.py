"""The llguidance grammar engine (``--structured-outputs-backend guidance``): Rust, no torch.

A constraint becomes an llguidance grammar (JSON Schema, regex, Lark; GBNF is translated to
Lark by llguidance's own converter; a choice list is a Lark alternation of string literals);
compiling it is building one ``LLMatcher`` in its initial state (llguidance drops the GIL
while it builds the grammar), which every sequence of the grammar then copies
(``deep_copy``). Masks are computed straight into the caller's numpy row."""

from __future__ import annotations

import json
import pathlib

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from controlplane.structured.spec import Constraint, ConstraintError

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


class GuidanceMatcher:
    __slots__ = ("_m", "_eos")

    def __init__(self, m: llguidance.LLMatcher, eos: np.ndarray):
        self._m, self._eos = m, eos

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
    def __init__(self, template: llguidance.LLMatcher, eos: np.ndarray):
        self._template, self._eos = template, eos

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy(), self._eos)


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer_file: pathlib.Path, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos = [t for t in eos_token_ids if t < vocab_size]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size,
                                                eos_token=self.eos or None)
        self.eos_row = eos_row(self.eos, vocab_size)
        self._executor = llguidance.LLExecutor()   # fills a batch's masks in parallel, GIL released

    def fill_rows(self, matchers: list[GuidanceMatcher], rows: np.ndarray, indexes: list[int]) -> None:
        """Each matcher's mask into ``rows[indexes[i]]`` (one call for the whole step)."""
        if len(matchers) == 1:
            matchers[0].fill(rows[indexes[0]])
            return
        pairs = []
        for m, i in zip(matchers, indexes):
            if m._m.is_error():
                rows[i] = self.eos_row
            else:
                pairs.append((m._m, i))
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, rows)

    def compile(self, constraint: Constraint) -> GuidanceCompiled:
        grammar = grammar_of(constraint)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(f"structured: {_field(constraint)} does not compile: "
                                  f"{template.get_error().strip()}")
        return GuidanceCompiled(template, self.eos_row)


def _field(constraint: Constraint) -> str:
    return {"json": "json_schema"}.get(constraint.kind, constraint.kind)
