"""Accuracy of every quantization scheme on the embedded default model (really trained on
*Pride and Prejudice*): perplexity on held-out text (the novel's last three chapters, which
``train.py`` keeps out of training) and greedy agreement with the unquantised model.

Greedy agreement: 8 held-out paragraph openings (32 tokens each) x 24 generated tokens; the
fraction of generated tokens equal to the float model's before the first divergence (as in
REFERENCE.md's measurement). ``python -m tests.test_quant_accuracy`` prints the table of
docs/quantization.md. INT4 checkpoints are round-to-nearest (not the GPTQ / AWQ algorithms) in
GPTQ's, AWQ's and compressed-tensors' layouts: this measures the formats and kernels' path.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import tempfile

import pytest
import torch

from headrace.dataplane import kv_cache
from headrace.dataplane.config import load_model_config
from headrace.dataplane.default_model import train
from headrace.dataplane.loader import load_model
from headrace.dataplane.model import AttentionMetadata
from headrace.dataplane.quantization import resolve
from headrace.kernels import reference_quant
from tests import quant_checkpoints as qc

pytestmark = pytest.mark.slow   # perplexity and greedy agreement of every scheme on the embedded model

TINY = pathlib.Path(train.__file__).parent / "tiny"
WINDOW, WINDOWS, PROMPTS, PROMPT_LEN, NEW = 256, 6, 8, 32, 24

# scheme -> (weights: how to make/load them, KV cache dtype)
SCHEMES = {
    "bf16-ckpt (float32 compute)": ("float", torch.float32),
    "fp8 w8a8 (online)": ("fp8", torch.float32),
    "int8 w8a16 (online)": ("int8", torch.float32),
    "fp8 kv cache": ("float", torch.float8_e4m3fn),
    "fp8 w8a8 + fp8 kv": ("fp8", torch.float8_e4m3fn),
    "fp8 w8a16 (the GPU's decode GEMMs)": ("fp8", torch.float32),
    "fp8 w8a16 + fp8 kv": ("fp8", torch.float8_e4m3fn),
    "gptq int4 g128 sym": ("gptq", torch.float32),
    "gptq int4 g128 act-order asym": ("gptq-act", torch.float32),
    "awq int4 g64": ("awq", torch.float32),
    "compressed-tensors w4a16 per-channel": ("ct-w4a16", torch.float32),
    "compressed-tensors fp8 dynamic": ("ct-fp8", torch.float32),
}
# FP8 rows run as weight-only W8A16 (x unquantised): the semantics of the GPU's skinny FP8 GEMMs,
# which take decode rows (the CPU reference is W8A8)
WEIGHT_ONLY_FP8 = ("fp8 w8a16 (the GPU's decode GEMMs)", "fp8 w8a16 + fp8 kv")
# (max perplexity ratio to float, min greedy agreement) per scheme, from the measured table
BOUNDS = {"fp8 w8a8 (online)": (1.01, 0.75), "int8 w8a16 (online)": (1.005, 0.95),
          "fp8 kv cache": (1.01, 0.8), "fp8 w8a8 + fp8 kv": (1.01, 0.7),
          "fp8 w8a16 (the GPU's decode GEMMs)": (1.005, 0.9), "fp8 w8a16 + fp8 kv": (1.01, 0.7),
          "gptq int4 g128 sym": (1.02, 0.45), "gptq int4 g128 act-order asym": (1.02, 0.35),
          "awq int4 g64": (1.01, 0.5), "compressed-tensors w4a16 per-channel": (1.01, 0.35),
          "compressed-tensors fp8 dynamic": (1.01, 0.75)}


@functools.lru_cache(maxsize=None)
def held_out() -> tuple[list[int], list[list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    chapters = train.read_chapters(TINY.parent / "corpus.txt")[-3:]
    stream, starts = train.encode_chapters(tok, chapters)
    prompts = [stream[s:s + PROMPT_LEN] for s in starts[::max(1, len(starts) // PROMPTS)]][:PROMPTS]
    return stream[:WINDOW * WINDOWS + 1], prompts


_DIR = tempfile.TemporaryDirectory(prefix="headrace-quant-acc-")


@functools.lru_cache(maxsize=None)
def checkpoint(kind: str) -> tuple[pathlib.Path, str | None]:
    """(the checkpoint's directory, its quantization method for ``resolve``) of ``kind``,
    written once under a temporary directory (the float and online kinds: the embedded model)."""
    path = pathlib.Path(_DIR.name) / kind
    if kind in ("float", "fp8", "int8"):
        src, method = TINY, None if kind == "float" else kind
    elif kind.startswith("gptq"):
        act = kind == "gptq-act"
        src, _ = qc.packed_checkpoint(path, "gptq", group_size=128, sym=not act, act_order=act,
                                      src=TINY)
        method = "gptq"
    elif kind == "awq":
        src, _ = qc.packed_checkpoint(path, "awq", group_size=64, src=TINY)
        method = None
    else:
        preset, fmt, group = (("W4A16", "pack-quantized", -1) if kind == "ct-w4a16"
                              else ("FP8_DYNAMIC", "float-quantized", 0))
        src, _ = qc.compressed_tensors_checkpoint(path, preset, fmt, group, src=TINY)
        method = None
    return src, method


@functools.lru_cache(maxsize=None)
def weights(kind: str):
    src, method = checkpoint(kind)
    cfg = load_model_config(src)
    return load_model(src, cfg, torch.device("cpu"), torch.float32, 1024, None,
                      resolve(src, method))


def measure(scheme: str) -> tuple[float, float]:
    """(perplexity, greedy agreement with the float model)."""
    if scheme in WEIGHT_ONLY_FP8:
        with _weight_only_fp8():
            return _measure(scheme)
    return _measure(scheme)


@contextlib.contextmanager
def _weight_only_fp8():
    real = reference_quant.fp8_linear
    reference_quant.fp8_linear = lambda x, w, s, input_scale=None, bias=None, dense=None: \
        reference_quant.fp8_weight_linear(x, w, s, bias, dense)
    try:
        yield
    finally:
        reference_quant.fp8_linear = real


def _measure(scheme: str) -> tuple[float, float]:
    kind, kv = SCHEMES[scheme]
    model = weights(kind)
    _, prompts = held_out()
    agree = sum(_agreement(greedy(model, p, kv), _float_greedy(tuple(p))) for p in prompts)
    return perplexity(model, kv), agree / (len(prompts) * NEW)


def perplexity(model, kv, device=torch.device("cpu")) -> float:
    """Held-out perplexity: WINDOWS windows of WINDOW tokens, each one prefill."""
    stream, _ = held_out()
    nll, count = 0.0, 0
    for w in range(WINDOWS):
        ids = stream[w * WINDOW:(w + 1) * WINDOW + 1]
        caches, table = _cache(model, len(ids), kv, device)
        logits = _forward(model, ids[:-1], 0, caches, table)
        nll += torch.nn.functional.cross_entropy(logits.cpu(), torch.tensor(ids[1:]),
                                                 reduction="sum").item()
        count += len(ids) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def greedy(model, prompt, kv, device=torch.device("cpu")) -> list[int]:
    """NEW greedy tokens: one prefill, then one decode step (one row) per token over the paged
    cache."""
    caches, table = _cache(model, len(prompt) + NEW, kv, device)
    out, ids, done = [], list(prompt), 0
    for _ in range(NEW):
        logits = _forward(model, ids, done, caches, table, last=True)
        done += len(ids)
        out.append(int(logits[-1].argmax()))
        ids = out[-1:]
    return out


def _cache(model, tokens: int, kv, device):
    """A fresh paged cache of 16-token blocks for ``tokens`` and its one-sequence block table."""
    blocks = -(-tokens // 16)
    return (kv_cache.allocate(model.cfg, blocks, 16, kv, device),
            torch.arange(blocks, dtype=torch.int32, device=device)[None])


def _forward(model, ids: list[int], done: int, caches, table, last: bool = False) -> torch.Tensor:
    """Float32 logits of ``ids`` after ``done`` cached tokens (on the table's device); ``last``:
    of the last position only."""
    device, n = table.device, len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(done, done + n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([done + n], dtype=torch.int32, device=device),
        block_tables=table)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=device),
                       torch.arange(done, done + n, device=device), caches, meta)
        return model.logits(hidden[-1:] if last else hidden).float()


@functools.lru_cache(maxsize=None)
def _float_greedy(prompt: tuple[int, ...]) -> list[int]:
    return greedy(weights("float"), list(prompt), torch.float32)


def _agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and a[n] == b[n]:
        n += 1
    return n


@functools.lru_cache(maxsize=None)
def _baseline() -> float:
    return measure("bf16-ckpt (float32 compute)")[0]


@pytest.mark.parametrize("scheme", list(BOUNDS))
def test_accuracy_within_bounds(scheme):
    ppl, agree = measure(scheme)
    max_ratio, min_agree = BOUNDS[scheme]
    assert ppl / _baseline() <= max_ratio, (scheme, ppl, _baseline())
    assert agree >= min_agree, (scheme, agree)


def test_the_gpu_script_measures_as_this_test_on_the_cpu():
    """``bench/quant_accuracy_gpu.py`` (run on the H200 in bfloat16) measures like this module:
    on the CPU in float32 it gives this module's perplexity and greedy agreement."""
    from bench import quant_accuracy_gpu

    scheme = "gptq int4 g128 sym"
    [(_, ppl, ratio, agree, agree_here)] = quant_accuracy_gpu.table(
        [scheme], torch.device("cpu"), torch.float32)
    want_ppl, want_agree = measure(scheme)
    assert ppl == pytest.approx(want_ppl, rel=1e-6)
    assert ratio == pytest.approx(want_ppl / _baseline(), rel=1e-6)
    assert agree == agree_here == want_agree


if __name__ == "__main__":
    base = _baseline()
    print("| scheme | held-out perplexity | vs float | greedy agreement |")
    print("|---|---|---|---|")
    for name in SCHEMES:
        p, a = measure(name)
        print(f"| {name} | {p:.3f} | {p / base:.4f} | {a:.1%} |")
