"""LoRA adapters with the rest of the engine: speculative decoding (n-gram drafts verified with
the adapter: the same greedy tokens as without speculation), structured outputs under an
adapter, data-parallel placement preferring a core that holds the adapter, the command line's
``--lora-modules``, and the data plane's ``--enable-lora`` with nothing to change for a worker
without it."""

from __future__ import annotations

import asyncio
import types

import pytest

from headrace.controlplane.engine.loop import Engine, EngineConfig
from headrace.controlplane.requests.tokenizer import ModelTokenizer
from headrace.controlplane.requests.validation import build_request
from headrace.dataplane.inprocess import InProcessWorkerGroup
from headrace.core.v1 import core_pb2 as cpb
from headrace.v1 import inference_pb2 as pb
from tests.checkpoints import make_checkpoint
from tests.lora_harness import make_adapter
from tests.spec_harness import NGRAM, worker

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-features")
    base = make_checkpoint(root / "base", "qwen2", heads=4, kv_heads=2, head_dim=32)
    return str(base), {"one": str(make_adapter(base, root / "one", seed=5)),
                       "two": str(make_adapter(base, root / "two", seed=6, r=4))}


async def _serve(model: str, w, adapters: dict, requests: list[tuple[str, dict]]):
    engine = Engine(InProcessWorkerGroup(w), EngineConfig(max_running=16, max_batched_tokens=256,
                                                          lora_modules=list(adapters.items())))
    engine.model_dir = model   # (structured outputs compile for its tokenizer)
    await engine.start(timeout=30)
    tok = ModelTokenizer(model)
    reqs = []
    for name, fields in requests:
        req = build_request(pb.GenerateRequest(**fields), tok, seq_ids=engine.seq_ids,
                            vocab_size=engine.info.vocab_size, max_model_len=engine.max_model_len,
                            eos_token_ids=list(engine.info.eos_token_ids))
        req.lora_name = name
        engine.submit(req)
        reqs.append(req)

    async def collect(req):
        tokens = []
        while not req.delivered:
            for msg in await req.next_responses():
                tokens += msg.token_ids
            assert req.failure is None, req.failure
        return tokens

    try:
        return await asyncio.wait_for(asyncio.gather(*map(collect, reqs)), 120), engine
    finally:
        await engine.stop()


@pytest.mark.slow
def test_speculative_decoding_verifies_with_the_adapter(model):
    base, adapters = model
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]   # repeats: n-gram drafts
    requests = [(name, dict(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=12,
                            ignore_eos=True, sampling=pb.SamplingParams(temperature=0)))
                for name in ("one", "", "two")]
    off, _ = asyncio.run(_serve(base, worker(base, None, **LORA), adapters, requests))
    on, engine = asyncio.run(_serve(base, worker(base, NGRAM, **LORA), adapters, requests))
    assert on == off and off[0] != off[1] != off[2]
    assert engine.scheduler.speculation.num_drafts > 0


def test_structured_outputs_under_an_adapter(model):
    pytest.importorskip("llguidance", reason="the default grammar engine is not installed")
    base, adapters = model
    choices = ["alpha", "beta gamma"]
    fields = dict(prompt="pick one", max_tokens=8, sampling=pb.SamplingParams(temperature=0),
                  structured=pb.StructuredOutputs(choice=pb.ChoiceList(choices=choices)))
    out, _ = asyncio.run(_serve(base, worker(base, None, **LORA), adapters,
                                [("one", fields), ("two", fields), ("", fields)]))
    tok = ModelTokenizer(base)
    for tokens in out:
        assert tok.decode([t for t in tokens if t != 1]) in choices


def test_a_worker_without_lora_is_unchanged(model):
    base, _ = model
    w = worker(base, None)
    assert w.lora is None and getattr(w.runner.model, "lora", None) is None
    assert type(w.runner.model.model.layers[0].self_attn.qkv_proj).__name__ == "Linear"


def test_placement_prefers_a_core_holding_the_adapter():
    from headrace.controlplane.frontend.router import CoreRouter
    from headrace.controlplane.frontend.placement import Placement

    def core(load, slots=(), cached=()):
        return types.SimpleNamespace(ready=True, load=load, match=lambda h: 0,
                                     core_load=cpb.CoreLoad(lora_in_slots=slots, lora_cached=cached))

    router = CoreRouter.__new__(CoreRouter)
    router.placement = Placement("least-load")
    request = types.SimpleNamespace(lora_name="one")
    cores = [core(0), core(5, cached=["one"]), core(9, slots=["one"])]
    chosen = router._lora_warm(request, cores)
    assert [c.ready for c in chosen] == [False, False, True]   # in a slot beats in a host cache
    cores = [core(0), core(5, cached=["one"])]
    assert [c.ready for c in router._lora_warm(request, cores)] == [False, True]
    cores = [core(0), core(100, slots=["one"])]                 # much busier: any core will do
    assert [c.ready for c in router._lora_warm(request, cores)] == [True, True]
    base = types.SimpleNamespace(lora_name="")
    assert router._lora_warm(base, cores) is cores


def test_command_line_options(tmp_path):
    from headrace.cli.configs import engine_config, lora_modules
    from headrace.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "4", "--lora-modules",
                                      "a=/x", '{"name": "b", "path": "/y"}'])
    assert engine_config(args).lora_modules == [("a", "/x"), ("b", "/y")]
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (4, 16, None)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_modules(build_parser().parse_args(["serve", "--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="give name=path"):
        lora_modules(build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a"]))
