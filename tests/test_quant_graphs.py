"""Quantized layers inside the decode CUDA graphs: each layer plans its kernel per row bucket at its
first (eager) GPU call, ``layers.warm_up`` runs every bucket before capture, and a decode step
replayed through ``headrace.dataplane.cuda_graphs.DecodeGraphs`` equals the eager step, with the
skinny kernels doing the work. Here the graphs are the CPU stand-ins and the quantized layers run
their Triton kernels under the interpreter (the rest of the model keeps the reference kernels);
tests/test_quant_gpu.py captures real graphs on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device()
from headrace import kernels  # noqa: E402
from headrace.dataplane import kv_cache  # noqa: E402
from headrace.dataplane.config import load_model_config  # noqa: E402
from headrace.dataplane.cuda_graphs import DecodeGraphs  # noqa: E402
from headrace.dataplane.loader import load_model  # noqa: E402
from headrace.dataplane.model import AttentionMetadata  # noqa: E402
from headrace.dataplane.quantization import layers, resolve  # noqa: E402
from headrace.kernels import (quant_dispatch, triton_fp8_linear, triton_quant, triton_w4a16,
                              triton_w4a16_tiled)
from tests import quant_checkpoints as qc  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the GPU twin is tests/test_quant_gpu.py")
BS, PROMPT = 16, 5


@pytest.fixture
def triton_quant_layers(monkeypatch):
    """The quantized layers take the Triton path (interpreted), everything else the reference."""
    monkeypatch.setattr(kernels, "_triton", ({"fp8_linear": triton_quant,
                                              "wna16_linear": triton_quant}, None))
    monkeypatch.setattr(kernels, "MODE", "triton")
    calls = []
    for module, name in ((triton_fp8_linear, "fp8_weight_linear"), (triton_w4a16, "w4a16_linear"),
                         (triton_w4a16_tiled, "w4a16_tiled_linear")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw:
                            calls.append((_name, a[0].reshape(-1, a[0].shape[-1]).shape[0]))
                            or _real(*a, **kw))
    return calls


def _meta(seq_lens, q_lens, tables):
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    slots = torch.cat([tables[i, (torch.arange(s - q, s) // BS)] * BS + torch.arange(s - q, s) % BS
                       for i, (s, q) in enumerate(zip(seq_lens, q_lens))]).long()
    return AttentionMetadata(slot_mapping=slots, query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=tables, max_query_len=max(q_lens),
                             decode_only=max(q_lens) == 1)


@pytest.mark.parametrize("kind", ["fp8", "gptq-int4", "gptq-int4-tiled"])
def test_a_quantized_decode_step_replays_like_the_eager_step(tmp_path, triton_quant_layers, kind,
                                                             monkeypatch):
    """gptq-int4-tiled: the table ranks the tiled INT4 kernel first for every shape and row
    count, so each layer makes its tiled copy at its plan, before capture."""
    if kind.endswith("tiled"):
        monkeypatch.setattr(quant_dispatch, "ranking", lambda *a: ["triton_tiled"])
    if kind == "fp8":
        path, method = qc.float_model(tmp_path)[0], "fp8"
    else:
        path, method = qc.packed_checkpoint(tmp_path, "gptq", group_size=128, act_order=True)[0], None
    model = load_model(path, load_model_config(path), torch.device("cpu"), torch.float32, 64, None,
                       resolve(path, method))
    plans = layers.warm_up(model, 4, torch.float32)
    skinny = {"fp8": "fp8_skinny", "gptq-int4": "triton_skinny"}.get(kind, "triton_tiled")
    assert plans and all(f"1: {skinny}" in line and f"4: {skinny}" in line for line in plans)
    batch, blocks = 3, 2
    caches = kv_cache.allocate(model.cfg, batch * blocks, BS, torch.float32, torch.device("cpu"))
    tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    ids = torch.randint(0, 300, (batch * PROMPT,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, torch.arange(PROMPT).repeat(batch), caches, _meta([PROMPT] * batch,
                                                                      [PROMPT] * batch, tables))
    eager_caches = [c.clone() for c in caches]
    graphs = DecodeGraphs(model, caches, 4, blocks, torch.device("cpu"))
    graphs.capture()
    triton_quant_layers.clear()
    step = torch.tensor([7, 42, 99])
    dev = dict(positions=torch.full((batch,), PROMPT), seq_lens=torch.full((batch,), PROMPT + 1,
               dtype=torch.int32), block_tables=tables, decode_order=torch.arange(batch,
               dtype=torch.int32),
               slot_mapping=tables[:, PROMPT // BS].long() * BS + PROMPT % BS)
    with torch.inference_mode():
        replayed = graphs.run(step, dev).clone()
        meta = _meta([PROMPT + 1] * batch, [1] * batch, tables)
        eager = model.logits(model(step, torch.full((batch,), PROMPT), eager_caches, meta))
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    kernel = {"fp8": "fp8_weight_linear", "gptq-int4": "w4a16_linear"}.get(kind,
                                                                           "w4a16_tiled_linear")
    # 4 projections a layer, replayed at the graph's padded batch of 4 rows
    assert triton_quant_layers.count((kernel, 4)) == 4 * model.cfg.num_layers
    if kind == "fp8":   # the reference is W8A8 (activations rounded too), the decode path W8A16
        return
    # the reference kernels agree with the Triton ones
    kernels.MODE, kernels._triton = "auto", None
    with torch.inference_mode():
        plain = model.logits(model(step, torch.full((batch,), PROMPT),
                                   [c.clone() for c in caches], meta))
    torch.testing.assert_close(plain, eager, atol=1e-3, rtol=1e-3)
