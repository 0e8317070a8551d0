"""Greedy continuations through the real gRPC planes match transformers token for token, with
requests of mixed prompt lengths admitted at different times; logprobs agree."""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest
import torch
import transformers

from tests.conftest import VARIANTS
from tests.harness import Planes, completion
from headrace.v1 import inference_pb2 as pb

NEW_TOKENS = 12


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    logprobs = torch.stack(out.logits, 0)[:, 0].float().log_softmax(-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, checkpoint_factory):
    path = checkpoint_factory(variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hash(variant) % 1000)
    planes = Planes(path, num_kv_blocks=128)
    try:
        def run(i: int):
            time.sleep(0.05 * i)  # staggered arrivals: later prompts join a running batch
            return planes.generate(prompt_token_ids=pb.TokenIds(ids=prompts[i]), max_tokens=NEW_TOKENS,
                                   ignore_eos=True, logprobs=3, sampling=pb.SamplingParams(temperature=0))

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, range(len(prompts))))
        for prompt, responses in zip(prompts, results):
            ids, _, reason = completion(responses)
            ref_ids, ref_logprobs = _hf_greedy(hf, prompt)
            assert ids == ref_ids, f"prompt {prompt}"
            assert reason == pb.FINISH_REASON_LENGTH
            ours = [lp for r in responses for lp in r.logprobs]
            assert len(ours) == NEW_TOKENS
            for step, lp in enumerate(ours):
                ref = ref_logprobs[step]
                assert lp.token_id == ids[step]
                assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-3)
                top_vals, top_ids = ref.topk(3)
                assert [t.token_id for t in lp.top] == top_ids.tolist()
                assert [t.logprob for t in lp.top] == pytest.approx(top_vals.tolist(), abs=1e-3)
        assert planes.wait_for_free_blocks(128) == 128
    finally:
        planes.close()


def test_repetition_penalty_matches_transformers(checkpoint_factory):
    """Penalties need each sequence's token history on the worker, also with two steps in
    flight (the step before is finished first): greedy with a repetition penalty matches
    transformers' RepetitionPenaltyLogitsProcessor token for token."""
    path = checkpoint_factory("llama-gqa4-hd64-untied")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    planes = Planes(path, num_kv_blocks=64)
    try:
        for prompt in _prompts(5, n=3):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
            ids, _, _ = completion(planes.generate(
                prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=NEW_TOKENS, ignore_eos=True,
                sampling=pb.SamplingParams(temperature=0, repetition_penalty=1.5)))
            assert ids == ref[0, len(prompt):].tolist()
    finally:
        planes.close()
