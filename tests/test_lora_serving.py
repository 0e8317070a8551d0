"""Multi-LoRA serving end to end, through the real gRPC planes and the HTTP API: requests of
three adapters and the base model at once (more adapters than device slots and host-cache
entries: loads and evictions on the way) give transformers + peft's greedy tokens; ``n`` > 1;
the OpenAI ``model`` field and the gRPC ``model`` field select the adapter, an unknown one is
NOT_FOUND / 404; ``/v1/models`` lists the adapters with ``parent``; vLLM's runtime
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` under the admin token; the prefix
cache never shares KV between adapters; the metrics name the adapters; and the same through an
engine core and an API front end (``headrace serve``'s split)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import httpx
import openai
import pytest

from headrace.controlplane.engine.loop import EngineConfig
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from tests.lora_harness import hf_greedy, hf_model, make_adapter

ADMIN = "admin-secret"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [300, 2, 77, 9, 13], [100, 101, 102, 103]]
NEW = 6
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    base = make_checkpoint(root / "base", "llama", heads=4, kv_heads=2, head_dim=32)
    adapters = {"one": make_adapter(base, root / "one", seed=1),
                "two": make_adapter(base, root / "two", seed=2, r=4, rslora=True),
                "three": make_adapter(base, root / "three", seed=3, targets=("q_proj", "v_proj"))}
    refs = {"": hf_model(base)} | {name: hf_model(base, path) for name, path in adapters.items()}
    expected = {name: [hf_greedy(m, p, NEW) for p in PROMPTS] for name, m in refs.items()}
    return base, adapters, expected, root


def _planes(base, adapters, **kw):
    modules = [(n, str(p)) for n, p in adapters.items()]
    options = kw.pop("plane_options", {"http_port": 0, "admin_token": ADMIN})
    return Planes(base, num_kv_blocks=128, config=EngineConfig(lora_modules=modules),
                  worker_fields=LORA, plane_options=options, **kw)


@pytest.fixture(scope="module")
def planes(model):
    base, adapters, _, _ = model
    p = _planes(base, adapters)
    yield p
    p.close()


def _greedy(planes, prompt, model="", **fields):
    return completion(planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=NEW,
                                      ignore_eos=True, sampling=pb.SamplingParams(temperature=0),
                                      model=model, **fields))[0]


def test_concurrent_requests_of_three_adapters_and_the_base_equal_peft(planes, model):
    """Three adapters over two slots and two host-cache entries, with the base model, all at
    once: each request gets peft's tokens (adapters wait for a slot; a slot in use is kept)."""
    _, _, expected, _ = model
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("", "one", "two", "three")]

    def run(job):
        name, i = job
        return _greedy(planes, PROMPTS[i], name)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    for (name, i), ids in zip(jobs, results):
        assert ids == expected[name][i], (name, i)
    lora = planes.engine.lora
    assert lora.slots.num_loads >= 3 and lora.num_reads >= 3   # evictions happened on the way
    assert planes.wait_for_free_blocks(128) == 128


def test_n_samples_share_their_adapter(planes, model):
    _, _, expected, _ = model
    responses = planes.generate(prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]), max_tokens=NEW,
                                ignore_eos=True, n=2, sampling=pb.SamplingParams(temperature=0),
                                model="two")
    by_index = {}
    for r in responses:
        by_index.setdefault(r.index, []).extend(r.token_ids)
    assert by_index == {0: expected["two"][0], 1: expected["two"][0]}


def test_unknown_models_are_not_found_and_model_info_lists_the_adapters(planes, model):
    base, adapters, _, _ = model
    with pytest.raises(grpc.RpcError) as err:
        _greedy(planes, PROMPTS[0], "four")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'one'" in err.value.details()
    assert _greedy(planes, PROMPTS[1], "base") == _greedy(planes, PROMPTS[1], "")   # its own name
    info = planes.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert {a.name: (a.path, a.parent) for a in info.lora_adapters} == {
        n: (str(p), "base") for n, p in adapters.items()}
    assert (info.max_loras, info.max_lora_rank) == (2, 8)


def test_python_client_and_admin_command(planes, model, capsys):
    from headrace.cli.main import main
    from headrace.client import Client, ModelNotFound

    _, _, expected, _ = model
    with Client(planes.address) as client:
        out = client.generate(token_ids=PROMPTS[1], max_tokens=NEW, ignore_eos=True, temperature=0,
                              model="one")
        assert out.token_ids == expected["one"][1]
        with pytest.raises(ModelNotFound, match="four"):
            client.generate(token_ids=PROMPTS[1], max_tokens=2, model="four")
    assert main(["admin", "--address", planes.address, "--api-token", ADMIN, "loras"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {a["adapter"]["name"] for a in listed["adapters"]} == {"one", "two", "three"}
    assert listed["maxLoras"] == 2


def test_prefix_cache_is_keyed_by_adapter(planes):
    prompt = list(range(20, 60))   # two full blocks and more
    cached = {}
    for name in ("one", "one", "two", ""):
        responses = planes.generate(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=2,
                                    sampling=pb.SamplingParams(temperature=0), model=name)
        cached.setdefault(name, []).append(responses[-1].usage.cached_prompt_tokens)
    assert cached["one"][0] == 0 and cached["one"][1] >= 32   # its own prefix, again
    assert cached["two"] == [0] and cached[""] == [0]          # never another adapter's KV


def test_http_models_completions_and_404(planes, model):
    base, adapters, expected, _ = model
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http.port}/v1", api_key="x",
                           max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "one", "two", "three"}
    assert cards["one"].parent == "base" and cards["one"].root == str(adapters["one"])
    assert cards["base"].parent is None
    out = client.completions.create(model="three", prompt=PROMPTS[2], max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    text = planes.plane.tokenizer.decode(expected["three"][2])
    assert out.choices[0].text == text and out.model == "three"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="four", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_metrics_name_the_adapters(planes):
    text = "\n".join(planes.plane.metrics.render().decode().splitlines()) \
        if hasattr(planes.plane.metrics, "render") else _scrape(planes)
    assert 'headrace:lora_requests_info{max_lora="2"' in text
    assert "headrace:lora_slot_loads_total" in text and 'headrace:lora_adapters{where="served"} 3.0' in text


def _scrape(planes) -> str:
    from prometheus_client import generate_latest

    return generate_latest(planes.plane.metrics.registry).decode()


def test_runtime_load_and_unload_over_http_and_admin(model):
    base, adapters, expected, root = model
    bad = make_adapter(make_checkpoint(root / "other", "llama", heads=4, kv_heads=2, head_dim=64),
                       root / "foreign", r=4)
    planes = _planes(base, {"one": adapters["one"]})
    try:
        url = f"http://127.0.0.1:{planes.plane.http.port}/v1"
        auth = {"Authorization": f"Bearer {ADMIN}"}
        body = {"lora_name": "two", "lora_path": str(adapters["two"])}
        assert httpx.post(f"{url}/load_lora_adapter", json=body).status_code == 401
        assert httpx.post(f"{url}/load_lora_adapter", json=body,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = httpx.post(f"{url}/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200 and "Success" in r.text
        assert _greedy(planes, PROMPTS[3], "two") == expected["two"][3]
        r = httpx.post(f"{url}/load_lora_adapter", json=body, headers=auth)   # vLLM's 400
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(root / "none")},
                       headers=auth)   # vLLM's 404 for no adapter at the path
        assert r.status_code == 404 and "no such adapter directory" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)},
                       headers=auth)
        assert r.status_code == 400 and "another base model" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root)},
                       headers=auth)
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"},
                       headers=auth)   # anywhere (no --model-root), but it must be an adapter
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        # an unload while the adapter runs: refused at once without a wait ...
        stream = planes.stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]), max_tokens=200, ignore_eos=True,
            model="two"), timeout=60)
        next(stream)
        r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "two", "wait_s": 0},
                       headers=auth)
        assert r.status_code == 409 and "in use by 1 sequences" in r.json()["error"]["message"]
        # ... and done once its request finished, with a wait
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            unload = pool.submit(httpx.post, f"{url}/unload_lora_adapter", json={"lora_name": "two"},
                                 headers=auth, timeout=60)
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as err:   # new requests are refused meanwhile
                _greedy(planes, PROMPTS[0], "two")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert sum(len(m.token_ids) for m in stream) == 199
            assert unload.result().status_code == 200
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "two"},
                          headers=auth).status_code == 404
        # the Admin service says the same
        admin = apb_grpc.AdminStub(planes.channel)
        meta = [("authorization", f"Bearer {ADMIN}")]
        listed = admin.ListLoraAdapters(apb.ListLoraAdaptersRequest(), metadata=meta)
        assert [s.adapter.name for s in listed.adapters] == ["one"] and listed.max_loras == 2
        admin.LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name="three", lora_path=str(adapters["three"])),
                              metadata=meta)
        assert _greedy(planes, PROMPTS[1], "three") == expected["three"][1]
        with pytest.raises(grpc.RpcError) as err:
            admin.UnloadLoraAdapter(apb.UnloadLoraAdapterRequest(lora_name="nope"), metadata=meta)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        planes.close()


@pytest.mark.slow
def test_split_engine_core_and_front_end(model):
    """Through an engine core and an API front end: the front end checks ``model`` against the
    adapters the core pushes, a runtime load reaches the core, and tokens equal peft's."""
    base, adapters, expected, _ = model
    planes = _planes(base, {"one": adapters["one"]}, split=True,
                     core_options={"core": {"admin_token": ADMIN}})
    try:
        assert _greedy(planes, PROMPTS[0], "one") == expected["one"][0]
        url = f"http://127.0.0.1:{planes.plane.http.port}/v1"
        r = httpx.post(f"{url}/load_lora_adapter", headers={"Authorization": f"Bearer {ADMIN}"},
                       json={"lora_name": "two", "lora_path": str(adapters["two"])})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while "two" not in {a.name for a in planes.plane.client.lora_adapters()}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _greedy(planes, PROMPTS[2], "two") == expected["two"][2]
        ids = httpx.get(f"{url}/models").json()["data"]
        assert [m["id"] for m in ids] == ["base", "one", "two"]
        with pytest.raises(grpc.RpcError) as err:
            _greedy(planes, PROMPTS[0], "three")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        planes.close()


@pytest.mark.slow
def test_tensor_parallel_ranks_apply_their_shards(tmp_path):
    """Two ``headrace dataplane`` ranks (gloo on a CPU; KV heads replicated: one KV head for two
    ranks) serve the adapters with peft's greedy tokens: A sharded like each layer's input, B
    like its output, the row-parallel layers' partial updates summed by their all-reduce."""
    from tests.test_tensor_parallel import _ranks

    base = make_checkpoint(tmp_path / "base", "qwen3", heads=4, kv_heads=1, head_dim=32)
    adapters = {"one": make_adapter(base, tmp_path / "one", seed=11),
                "two": make_adapter(base, tmp_path / "two", seed=12, r=4, targets=("k_proj", "o_proj", "down_proj"))}
    expected = {name: hf_greedy(hf_model(base, path), PROMPTS[0], NEW) for name, path in adapters.items()}
    flags = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    with _ranks(base, 2, flags) as (_, addresses):
        planes = Planes(base, workers=addresses, config=EngineConfig(
            lora_modules=[(n, str(p)) for n, p in adapters.items()]))
        try:
            for name in adapters:
                assert _greedy(planes, PROMPTS[0], name) == expected[name], name
        finally:
            planes.close()


def test_an_operators_model_roots_limit_runtime_loads(model):
    """With --model-root, a runtime load outside the roots is refused as ReloadModel's model
    is (one message whether or not the path exists); without it, the admin token suffices."""
    base, adapters, _, root = model
    planes = _planes(base, {}, plane_options={"http_port": 0, "admin_token": ADMIN,
                                              "model_roots": [str(root / "elsewhere")]})
    try:
        url = f"http://127.0.0.1:{planes.plane.http.port}/v1"
        auth = {"Authorization": f"Bearer {ADMIN}"}
        for path in (str(adapters["two"]), "/etc", "/no/such/dir"):
            r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": path},
                           headers=auth)
            assert r.status_code == 403 and "--model-root" in r.json()["error"]["message"], path
    finally:
        planes.close()

