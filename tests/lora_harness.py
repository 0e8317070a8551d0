"""LoRA adapters for tests: random PEFT adapters of a tiny checkpoint (made with peft itself),
greedy references from transformers + peft (the adapter unmerged, or merged into the
weights), and a driver that decodes sequences of mixed adapters on a worker through its
step protocol (``ModelRunner.launch`` / ``finish``)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from headrace.worker.v1 import worker_pb2 as wpb

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft():
    return pytest.importorskip("peft", reason="peft is not installed (pip install 'headrace[test]')")


def make_adapter(model_dir, out_dir, *, seed: int = 0, r: int = 8, alpha: float = 16,
                 targets=ALL, rslora: bool = False, std: float = 0.15, **config) -> pathlib.Path:
    """A random LoRA adapter of ``model_dir`` saved by peft (A and B drawn with ``std``, so it
    changes greedy outputs)."""
    import transformers

    p = peft()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = p.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                       init_lora_weights=False, **config)
    model = p.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    out_dir = pathlib.Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def hf_model(model_dir, adapter_dir=None, merged: bool = False):
    """transformers' model, with the adapter applied by peft (``merged``: into the weights)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft().PeftModel.from_pretrained(model, str(adapter_dir))
        if merged:
            model = model.merge_and_unload()
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_on_worker(worker, seqs: list[tuple[list[int], int]], n: int,
                     loads: list[tuple[int, int]] = (), block_size: int | None = None,
                     first_step: int = 1) -> list[list[int]]:
    """Greedy tokens of each (prompt, lora_slot) sequence (slot 0: the base model), all
    prefilled in the first step (after ``loads``: (slot, adapter id)), then decoded together."""
    runner = worker.runner
    bs = block_size or worker.opts.block_size
    step = wpb.StepRequest(step_id=first_step, flush=True)
    for slot, adapter_id in loads:
        step.lora_loads.add(slot=slot, adapter_id=adapter_id)
    next_block, tables = 0, []
    for i, (prompt, slot) in enumerate(seqs):
        need = -(-(len(prompt) + n) // bs)
        blocks = list(range(next_block, next_block + need))
        next_block += need
        tables.append(blocks)
        step.new_seqs.add(seq_id=i + 1, prompt_token_ids=prompt, block_ids=blocks,
                          num_scheduled_tokens=len(prompt), lora_slot=slot,
                          sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    out = [[] for _ in seqs]
    step_id = first_step
    for _ in range(n):
        result = runner.finish(runner.launch(step))
        for sid, token in zip(result.seq_ids, result.token_ids):
            out[sid - 1].append(token)
        step_id += 1
        step = wpb.StepRequest(step_id=step_id, flush=True, running_seq_ids=range(1, len(seqs) + 1),
                               running_num_scheduled=[1] * len(seqs),
                               running_new_block_counts=[0] * len(seqs))
    runner.finish(runner.launch(wpb.StepRequest(step_id=step_id + 1, finished_seq_ids=range(1, len(seqs) + 1))))
    return out
