"""A prompt is tokenized only as far as ``max_model_len`` tokens can reach
(``ModelTokenizer.encode_within``): one that can never fit is refused after counting about
that many tokens, in time and memory proportional to the model's context, not to the text
(issue 29: a 2.4 MB prompt to a 131,072-token model was tokenized whole, 27-47 s and ~1.7 GB);
one that fits is tokenized exactly as before."""

from __future__ import annotations

import json
import random
import shutil
import string
import threading
import time

import grpc
import httpx
import psutil
import pytest

from headrace.controlplane.requests import tokenizer as tokenizer_module
from headrace.controlplane.requests.tokenizer import ModelTokenizer, TooLong
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes

MODEL = default_model_dir()


def _random_text(chars: int, seed: int = 0) -> str:
    """About one token a character with the embedded tokenizer (as the issue's prompt)."""
    alphabet = string.ascii_letters + string.digits + " .,;"
    return "".join(random.Random(seed).choices(alphabet, k=chars))


def test_pieces_cover_the_text_and_cut_at_whitespace():
    text = _random_text(100_000) + "x" * 50_000   # a long run without whitespace is cut too
    pieces = list(tokenizer_module._pieces(text))
    assert "".join(pieces) == text and len(pieces) >= 150_000 // tokenizer_module.PIECE_CHARS
    assert all(len(p) <= tokenizer_module.PIECE_CHARS for p in pieces)
    assert all(p[-1] in " \n" for p in pieces[:5])


def test_encode_within_counts_only_as_far_as_the_limit():
    tok = ModelTokenizer(MODEL)
    fits = "It is a truth universally acknowledged. " * 300
    assert tok.encode_within(fits, 8192) == tok.encode(fits)
    assert tok.count_beyond(fits, len(tok.encode(fits))) is None   # exactly at the limit: may fit
    calls = []
    tok.tokenizer = _Spy(tok.tokenizer, calls)
    with pytest.raises(TooLong) as exc:
        tok.encode_within(_random_text(1_000_000), 100_000)
    assert exc.value.at_least > 100_000
    batch = tokenizer_module.PIECES_AT_ONCE * tokenizer_module.PIECE_CHARS
    assert sum(calls) <= 110_000 + batch, sum(calls)   # the limit's worth, not a million characters


class _Spy:
    """A tokenizer that records how many characters each encode_batch call was given."""

    def __init__(self, inner, calls: list):
        self._inner, self._calls = inner, calls

    def encode_batch(self, texts, **kwargs):
        self._calls.append(sum(map(len, texts)))
        return self._inner.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """The embedded model with a 131,072-token context (its config) and a KV pool that holds it."""
    path = tmp_path_factory.mktemp("long") / "tiny-131k"
    shutil.copytree(MODEL, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (path / "config.json").write_text(json.dumps(config))
    planes = Planes(path, num_kv_blocks=8192, block_size=16, worker_fields={"dtype": "bfloat16"},
                    plane_options=dict(http_port=0))
    yield planes
    planes.close()


def _peak_growth(fn) -> tuple[float, int, object]:
    """(seconds, peak RSS growth in bytes, result or exception) of ``fn()``."""
    me, stop = psutil.Process(), threading.Event()
    base = peak = me.memory_info().rss

    def watch():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        result = exc
    took = time.monotonic() - t
    stop.set()
    watcher.join()
    return took, peak - base, result


def test_a_prompt_that_can_never_fit_is_refused_quickly_and_small(long_context):
    planes = long_context
    assert planes.engine.max_model_len == 131072
    prompt = _random_text(2_400_000)   # ~2.3M tokens; within the old byte bound (~2.55 MB)
    assert len(prompt.encode()) < planes.plane.requests.max_text_bytes
    took, grew, result = _peak_growth(lambda: planes.generate(prompt=prompt, max_tokens=1))
    assert isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in result.details() and "more than 131071 tokens" in result.details()
    assert took < 10 and grew < 300 << 20, (took, grew >> 20)
    url = f"http://127.0.0.1:{planes.plane.http.port}/v1/completions"
    took, grew, r = _peak_growth(lambda: httpx.post(url, json={"prompt": prompt, "max_tokens": 1}, timeout=60))
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert took < 10 and grew < 300 << 20, (took, grew >> 20)
    took, grew, result = _peak_growth(lambda: planes.stub.Tokenize(pb.TokenizeRequest(text=prompt), timeout=60))
    assert isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text has more than 131072 tokens" in result.details() and took < 10 and grew < 300 << 20
    # a prompt that fits is still served
    out = planes.generate(prompt="It is a truth " * 100, max_tokens=2, ignore_eos=True)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
