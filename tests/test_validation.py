"""Request validation's messages say what to change: a request too long for max_model_len names
the prompt's length beside max_tokens (either may be the one to cut), and the cap on ``n`` is
the server's ``--max-n`` alone, whichever API a request comes through."""

from __future__ import annotations

import itertools

import pytest

from headrace.controlplane.requests import validation
from headrace.controlplane.http.protocol import ChatCompletionRequest, CompletionRequest
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb

MAX_LEN = 64
VOCAB = 4096   # at least the embedded tokenizer's ids


@pytest.fixture(scope="module")
def tokenizer():
    return ModelTokenizer(default_model_dir())


def _build(req, tokenizer, max_n=16):
    validation.check_request(req, vocab_size=VOCAB, max_model_len=MAX_LEN, max_n=max_n)
    return validation.build_request(req, tokenizer, seq_ids=itertools.count(1), vocab_size=VOCAB,
                                    max_model_len=MAX_LEN, eos_token_ids=[], max_n=max_n, checked=True)


@pytest.mark.parametrize("max_tokens", [MAX_LEN, MAX_LEN - 1, 10 * MAX_LEN])
def test_a_text_prompt_too_long_with_its_max_tokens_names_both(tokenizer, max_tokens):
    prompt = "It is a truth universally acknowledged"
    n = len(tokenizer.encode(prompt))
    with pytest.raises(validation.ValidationError) as info:
        _build(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), tokenizer)
    message = str(info.value)
    assert f"prompt {n} tokens + max_tokens {max_tokens} > max_model_len {MAX_LEN}" in message
    assert f"lower max_tokens to at most {MAX_LEN - n}" in message
    assert len(_build(pb.GenerateRequest(prompt=prompt, max_tokens=MAX_LEN - n), tokenizer).sequences) == 1


def test_token_ids_too_long_with_their_max_tokens_are_refused_before_anything_else(tokenizer):
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 10), max_tokens=MAX_LEN - 9)
    with pytest.raises(validation.ValidationError, match=rf"prompt 10 tokens \+ max_tokens {MAX_LEN - 9} > "
                                                         rf"max_model_len {MAX_LEN}"):
        validation.check_request(req, vocab_size=VOCAB, max_model_len=MAX_LEN)
    req.max_tokens = MAX_LEN - 10
    validation.check_request(req, vocab_size=VOCAB, max_model_len=MAX_LEN)


def test_the_n_limit_is_the_servers_max_n_for_every_api(tokenizer):
    too_many = r"n must be in \[1, 16\] \(the server's --max-n\), got 20"
    with pytest.raises(validation.ValidationError, match=too_many):
        _build(pb.GenerateRequest(prompt="hi", max_tokens=2, n=20), tokenizer)
    assert len(_build(pb.GenerateRequest(prompt="hi", max_tokens=2, n=20), tokenizer, max_n=32).sequences) == 20
    # the HTTP bodies leave the cap to the same check (no second, different bound of their own)
    for model in (CompletionRequest(prompt="hi", n=100), ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], n=100)):
        assert model.n == 100


def test_logit_bias_is_checked_and_reaches_every_sample(tokenizer):
    def biased(bias: dict, n: int = 1):
        return pb.GenerateRequest(prompt="hi", max_tokens=2, n=n,
                                  sampling=pb.SamplingParams(logit_bias=bias))

    request = _build(biased({7: 2.5, VOCAB - 1: -100}, n=2), tokenizer)
    assert [dict(s.sampling.logit_bias) for s in request.sequences] == [{7: 2.5, VOCAB - 1: -100.0}] * 2
    for bias, words in (({VOCAB: 1.0}, f"token id {VOCAB} is out of vocabulary"),
                        ({5: 100.5}, r"bias of token 5 must be in \[-100, 100\]"),
                        ({5: float("nan")}, "bias of token 5"),
                        ({t: 1.0 for t in range(validation.MAX_LOGIT_BIAS + 1)}, "at most 1024 entries")):
        with pytest.raises(validation.ValidationError, match=words):
            _build(biased(bias), tokenizer)
