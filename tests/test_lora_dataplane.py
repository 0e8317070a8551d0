"""Multi-LoRA serving on the data plane: PEFT adapters read, checked and sharded
(``headrace.dataplane.lora.adapter``), packed into slots (``headrace.dataplane.lora.slots``) and applied in the
model's projections (``headrace.dataplane.lora.layers``): greedy tokens equal transformers + peft's
(unmerged and merged), in batches mixing three adapters and the base model, each sequence as
it decodes alone; with the CUDA graphs' stand-ins too (tests/graphs.py). Also: what the
worker refuses, and with which message."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from headrace.dataplane.lora import batch as lora_batch
from headrace.dataplane.lora.adapter import AdapterError
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.worker.v1 import worker_pb2 as wpb
from tests import graphs
from tests.checkpoints import make_checkpoint
from tests.lora_harness import greedy_on_worker, hf_greedy, hf_model, make_adapter

CUDA = os.environ.get("HEADRACE_TEST_DEVICE", "cpu").startswith("cuda")
PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 8, 250, 31], [60, 61, 62, 63, 64, 65, 66, 67, 68], [2, 300, 12]]
NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A qwen3 checkpoint (q/k norm, GQA) and three adapters: all 7 projections at rank 8,
    attention only at rank 4 with rsLoRA, and the MLP only with a rank pattern."""
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", "qwen3", heads=4, kv_heads=2, head_dim=32)
    adapters = [
        make_adapter(base, root / "all", seed=1, r=8, alpha=16),
        make_adapter(base, root / "attn", seed=2, r=4, alpha=8, rslora=True,
                     targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        make_adapter(base, root / "mlp", seed=3, r=8, alpha=32, targets=("gate_proj", "up_proj", "down_proj"),
                     rank_pattern={"down_proj": 4}, alpha_pattern={"up_proj": 8}),
    ]
    return base, adapters


def _worker(base, **options) -> Worker:
    opts = dict(model=str(base), device="cuda" if CUDA else "cpu", dtype="float32",
                num_kv_blocks=128, block_size=16, max_num_seqs=8, max_batched_tokens=64,
                enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    return Worker(WorkerOptions(**(opts | options)))


def _cache(worker, adapters):
    for i, path in enumerate(adapters):
        worker.load_adapter(wpb.LoadAdapterRequest(adapter_id=100 + i, path=str(path)))


def test_mixed_batch_equals_peft_unmerged_and_merged(model):
    base, adapters = model
    worker = _worker(base)
    _cache(worker, adapters)
    loads = [(1, 100), (2, 101), (3, 102)]
    seqs = [(PROMPTS[0], 1), (PROMPTS[1], 2), (PROMPTS[2], 0), (PROMPTS[3], 3)]
    mixed = greedy_on_worker(worker, seqs, NEW, loads)
    refs = [hf_model(base), *(hf_model(base, a) for a in adapters)]
    for (prompt, slot), got in zip(seqs, mixed):
        assert got == hf_greedy(refs[slot], prompt, NEW), f"slot {slot}"
    merged = hf_model(base, adapters[0], merged=True)
    assert mixed[0] == hf_greedy(merged, PROMPTS[0], NEW)
    # each alone gives the tokens it got in the mixed batch; the base model is not the adapter's
    for (prompt, slot), got in zip(seqs, mixed):
        assert greedy_on_worker(worker, [(prompt, slot)], NEW, first_step=100) == [got]
    assert greedy_on_worker(worker, [(PROMPTS[0], 0)], NEW, first_step=200) != [mixed[0]]


def test_graph_stand_ins_replay_the_lora_variant(model):
    """The CUDA graphs' buffer logic (stand-ins off CUDA): decode steps in the decode graphs,
    the prefill in the piecewise ones, the LoRA variant only where a token has an adapter."""
    base, adapters = model
    worker = _worker(base)
    g = graphs.attach(worker)
    assert g.decode.variants == (False, True) and g.mixed.variants == (False, True)
    assert len(g.decode.lora_graphs) == len(g.decode.graphs)
    _cache(worker, adapters[:2])
    modes = graphs.record_modes(worker.runner)
    seqs = [(PROMPTS[0], 1), (PROMPTS[1], 0), (PROMPTS[3], 2)]
    got = greedy_on_worker(worker, seqs, NEW, [(1, 100), (2, 101)])
    assert ("decode", "full") in modes and ("prefill", "piecewise") in modes
    eager = _worker(base, enforce_eager=True)
    _cache(eager, adapters[:2])
    assert got == greedy_on_worker(eager, seqs, NEW, [(1, 100), (2, 101)])


def test_tensor_parallel_shards_sum_to_the_whole_update(model):
    """Each rank's shard (A like the layer's input, B like its output) applied to its part of
    the projection gives, concatenated (column-parallel) or summed (row-parallel), the update
    of the unsharded adapter."""
    from headrace.dataplane.config import load_model_config
    from headrace.dataplane.lora import adapter as lora_adapter
    from headrace.dataplane.parallel import Shard

    base, adapters = model
    cfg = load_model_config(base)
    whole = lora_adapter.load(adapters[0], cfg, None, 8, torch.float32).weights
    parts = [lora_adapter.load(adapters[0], cfg, Shard.of(cfg, r, 2), 8, torch.float32).weights
             for r in range(2)]
    x = torch.randn(3, cfg.hidden_size)
    for proj in ("q_proj", "k_proj", "gate_proj"):
        a, b = whole[(1, proj)]
        cat = torch.cat([x @ p[(1, proj)][0].t() @ p[(1, proj)][1].t() for p in parts], dim=-1)
        torch.testing.assert_close(cat, x @ a.t() @ b.t())
    for proj, width in (("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)):
        a, b = whole[(0, proj)]
        xin = torch.randn(3, width)
        halves = xin.chunk(2, dim=-1)
        total = sum(h @ p[(0, proj)][0].t() @ p[(0, proj)][1].t() for h, p in zip(halves, parts))
        torch.testing.assert_close(total, xin @ a.t() @ b.t(), atol=1e-4, rtol=1e-4)


def _edit(path, tmp_path, name, config=None, drop=None):
    import shutil

    out = tmp_path / name
    shutil.copytree(path, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"trainable_token_indices": [1, 2]}, "trainable token"),
    ({"r": 64}, "over --max-lora-rank 8"),
    ({"peft_type": "IA3"}, "only LoRA"),
    ({"bias": "all"}, "biases"),
    ({"auto_mapping": {"base_model_class": "LlamaForCausalLM"}}, "trained for a LlamaForCausalLM"),
])
def test_unservable_adapters_are_refused_with_the_reason(model, tmp_path, change, message):
    from headrace.dataplane.config import load_model_config
    from headrace.dataplane.lora import adapter as lora_adapter

    base, adapters = model
    bad = _edit(adapters[0], tmp_path, "bad", change)
    with pytest.raises(AdapterError, match=message):
        lora_adapter.load(bad, load_model_config(base), None, 8, torch.float32)


def test_adapters_of_another_base_model_or_unread_files_are_refused(model, tmp_path):
    from headrace.dataplane.config import load_model_config
    from headrace.dataplane.lora import adapter as lora_adapter

    base, adapters = model
    other = make_checkpoint(tmp_path / "other", "qwen3", heads=4, kv_heads=2, head_dim=64)
    foreign = make_adapter(other, tmp_path / "foreign", r=4)
    cfg = load_model_config(base)
    with pytest.raises(AdapterError, match="another base model"):
        lora_adapter.load(foreign, cfg, None, 8, torch.float32)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        lora_adapter.load(tmp_path, cfg, None, 8, torch.float32)
    with pytest.raises(AdapterError, match="no such adapter directory"):
        lora_adapter.load(tmp_path / "missing", cfg, None, 8, torch.float32)
    broken = _edit(adapters[0], tmp_path, "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot be read"):
        lora_adapter.load(broken, cfg, None, 8, torch.float32)


def test_worker_options_and_protocol_mistakes(model):
    base, adapters = model
    with pytest.raises(ValueError, match="--max-cpu-loras 1: must be >= --max-loras"):
        _worker(base, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="--max-lora-rank 0"):
        _worker(base, max_lora_rank=0)
    worker = _worker(base, max_loras=1, max_cpu_loras=1)
    info = worker.describe()
    assert (info.max_loras, info.max_lora_rank, info.max_cpu_loras) == (1, 8, 1)
    assert info.lora_slot_bytes == worker.lora.slots.slot_bytes > 0
    _cache(worker, adapters[:2])   # (the control plane keeps it within 1: drops ride on steps)
    with pytest.raises(ValueError, match="--max-cpu-loras 1"):   # beyond twice that: refused
        worker.load_adapter(wpb.LoadAdapterRequest(adapter_id=7, path=str(adapters[2])))
    step = wpb.StepRequest(step_id=1, lora_drops=[101])   # loads first, then drops
    step.lora_loads.add(slot=1, adapter_id=101)
    worker.runner.finish(worker.runner.launch(step))
    assert list(worker.lora.slots.host) == [100] and worker.lora.slots.held == [101]
    worker.load_adapter(wpb.LoadAdapterRequest(adapter_id=7, path=str(adapters[2])))
    worker.lora.slots.drop([], below=101)   # a fresh control plane: every id below its first
    assert list(worker.lora.slots.host) == []
    step = wpb.StepRequest(step_id=2)
    step.lora_loads.add(slot=1, adapter_id=100)   # dropped from the cache
    with pytest.raises(lora_batch.BatchError, match="not in the worker's host cache"):
        worker.runner.launch(step)
    plain = Worker(WorkerOptions(model=str(base), device="cpu", dtype="float32", num_kv_blocks=16))
    assert plain.describe().max_loras == 0
    with pytest.raises(RuntimeError, match="without --enable-lora"):
        plain.load_adapter(wpb.LoadAdapterRequest(adapter_id=1, path=str(adapters[0])))
    step = wpb.StepRequest(step_id=1)
    step.new_seqs.add(seq_id=1, prompt_token_ids=[1, 2], block_ids=[0], num_scheduled_tokens=2,
                      lora_slot=1, sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    with pytest.raises(lora_batch.BatchError, match="without --enable-lora"):
        plain.runner.launch(step)


def test_plan_groups_tokens_by_slot_and_cuts_them_into_blocks():
    slots = np.array([-1, 2, 0, 2, -1, 0, 1] + [1] * 20)
    p = lora_batch.plan(slots, 3, 40)
    small, large = lora_batch.layout(3, 40)   # rows: ceil(40 / 16) + 3, ceil(40 / 64) + 3
    assert (small, large) == (6, 4)
    blocks16 = p.array[:3 * small].reshape(small, 3).tolist()
    blocks64 = p.array[3 * small:3 * (small + large)].reshape(large, 3).tolist()
    order = p.array[3 * (small + large):]
    # slot 0: 2 tokens at 0; slot 1: 21 at 2 (a block of 16, then 5); slot 2: 2 at 23
    assert blocks16 == [[0, 0, 2], [1, 2, 16], [1, 18, 5], [2, 23, 2], [0, 0, 0], [0, 0, 0]]
    assert blocks64 == [[0, 0, 2], [1, 2, 21], [2, 23, 2], [0, 0, 0]]
    assert order[:5].tolist() == [2, 5, 6, 7, 8] and order[-2:].tolist() == [1, 3]
    assert p.slots == (0, 1, 2) and p.segments == ((0, 0, 2), (1, 2, 21), (2, 23, 2))
    assert lora_batch.plan(np.full(4, -1), 3, 40) is None and lora_batch.plan(None, 3, 40) is None
    with pytest.raises(lora_batch.BatchError, match="LoRA slot 4"):
        lora_batch.plan(np.array([3]), 3, 40)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantized_projections_add_the_update_to_their_output(model, scheme):
    """A quantized model serves adapters: each projection's output is the quantized layer's
    plus the update (its input never pre-quantised for it); a mixed batch equals its parts."""
    from headrace.dataplane.lora.layers import LoraProjection

    base, adapters = model
    worker = _worker(base, quantization=scheme)
    _cache(worker, adapters[:1])
    worker.runner.finish(worker.runner.launch(_load_step(1, 100)))
    proj = worker.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(proj, LoraProjection) and not proj.wants_fp8_rows(torch.zeros(2, 8))
    x = torch.randn(3, proj.lora_a.shape[2])
    batch = proj.batch
    step = lora_batch.plan(np.array([0, -1, 0]), 3, batch.max_tokens)
    batch.begin(step, torch.tensor(step.array))
    try:
        got = proj(x)
    finally:
        batch.begin(None, None)
    want = proj.base(x)
    a, b = proj.lora_a[0], proj.lora_b[0]
    r = b.shape[1]
    for i, (lo, hi) in enumerate(zip(proj.slices, proj.slices[1:])):
        want[[0, 2], lo:hi] += x[[0, 2]] @ a[i * r:(i + 1) * r].t() @ b[lo:hi].t()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    seqs = [(PROMPTS[0], 1), (PROMPTS[1], 0)]
    mixed = greedy_on_worker(worker, seqs, 4, first_step=10)
    assert mixed == [greedy_on_worker(worker, [s], 4, first_step=20 + i)[0] for i, s in enumerate(seqs)]


def _load_step(slot: int, adapter_id: int) -> wpb.StepRequest:
    step = wpb.StepRequest(step_id=1)
    step.lora_loads.add(slot=slot, adapter_id=adapter_id)
    return step


@pytest.mark.parametrize("family,options", [("qwen2", dict(heads=4, kv_heads=2, tie=True)),   # qkv bias
                                            ("mistral", dict(heads=4, kv_heads=1))])
def test_every_family_equals_peft(tmp_path, family, options):
    base = make_checkpoint(tmp_path / "base", family, head_dim=32, **options)
    adapter = make_adapter(base, tmp_path / "lora", seed=9, r=4, alpha=8)
    worker = _worker(base)
    _cache(worker, [adapter])
    got = greedy_on_worker(worker, [(PROMPTS[0], 1), (PROMPTS[2], 0)], NEW, [(1, 100)])
    assert got == [hf_greedy(hf_model(base, adapter), PROMPTS[0], NEW),
                   hf_greedy(hf_model(base), PROMPTS[2], NEW)]
