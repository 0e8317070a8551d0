"""Stop strings across chunk boundaries and UTF-8-safe incremental text."""

from __future__ import annotations

import pathlib

import pytest

from headrace.controlplane.requests.output import OutputText
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from tests.checkpoints import write_tokenizer


class FakeDecoder:
    """Yields one scripted piece per token id (the id indexes the script)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def step(self, token_id):
        return self.pieces[token_id]

    def flush(self):
        return ""


def _stream(pieces, stop):
    out = OutputText(FakeDecoder(pieces), stop)
    sent = []
    for i in range(len(pieces)):
        stopped = out.add(i)
        sent.append(out.delta(final=stopped or i == len(pieces) - 1))
        if stopped:
            return "".join(sent), True
    return "".join(sent), False


@pytest.mark.parametrize("pieces,stop,expect,stopped", [
    (["Hel", "lo wo", "rld"], ["o w"], "Hell", True),
    (["ab", "c", "STO", "P", "tail"], ["STOP"], "abc", True),
    (["ab", "cS", "TOx"], ["STOP"], "abcSTOx", False),
    (["x", "yEN", "Dz"], ["END", "yE"], "x", True),
    (["no", " stop", " here"], [], "no stop here", False),
])
def test_stop_strings_across_chunks(pieces, stop, expect, stopped):
    assert _stream(pieces, stop) == (expect, stopped)


def test_streaming_holds_back_only_a_possible_stop_prefix():
    out = OutputText(FakeDecoder(["abcde", "ST", "Oq"]), ["STOP"])
    out.add(0)
    assert out.delta(final=False) == "ab"     # the last 3 characters could begin "STOP"
    out.add(1)
    assert out.delta(final=False) == "cd"
    assert not out.add(2)
    assert out.delta(final=True) == "eSTOq"


def test_incremental_decode_never_splits_characters(tmp_path: pathlib.Path):
    write_tokenizer(tmp_path)
    tok = ModelTokenizer(tmp_path)
    text = "héllo wörld — ünïcode ✓ 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    dec = tok.decode_stream([])
    pieces = [dec.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
