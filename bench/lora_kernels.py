"""The LoRA update's device time beside the projections it rides on (issue 53's prediction before
the serving runs): per merged projection of a model (q/k/v, o, gate/up, down), the base GEMM
(``kernels.linear``) and ``kernels.lora_add`` (shrink + expand over the step's tokens grouped by
slot) at decode and prefill token counts, with the tokens spread over 1 or ``--mix`` adapters of
rank ``--rank`` in ``--slots`` slots; each replayed from a CUDA graph (µs a call), after a check
of the update against the torch reference. The per-layer sums times the layer count give the
step's added device time, hence the expected W2 ITL ratio (batch 1) and W1's cost (large
batches): printed as a table and one JSON line.

    python -m bench.lora_kernels --model qwen3-0.6b,llama-3.1-8b [--tokens 1,16,64,256,2048]

At most 64 tokens the table also times the fused one-launch kernel the decode path used before
session 28 (``fused_us``), beside the served shrink + expand with K split over programs. At
most 16 tokens it times ``kernels.lora_linear`` (``one_launch_us``: the projection and its
update in one launch where it applies, else the same three launches): the served decode path
since session 29; ``step_one_launch_ms`` against ``step_projections_ms + step_lora_ms``.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.random_checkpoint import CONFIGS

GRAPH_CALLS = 20


def _shapes(cfg: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """merged projection -> (in features, slice boundaries of its output)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv": (h, (0, q, q + kv, q + 2 * kv)), "o": (q, (0, h)),
            "gate_up": (h, (0, i, 2 * i)), "down": (i, (0, h))}


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def measure(name: str, tokens: int, mix: int, args) -> dict:
    from headrace import kernels
    from headrace.kernels import reference_lora, triton_lora

    cfg, dev, dtype = CONFIGS[name], torch.device("cuda"), torch.bfloat16
    rank, slots = args.rank, args.slots
    row = {"model": name, "tokens": tokens, "adapters": mix}
    total_base = total_lora = total_one = 0.0
    for proj, (k, slices) in _shapes(cfg).items():
        n, pieces = slices[-1], len(slices) - 1
        x = torch.randn(tokens, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        a = torch.randn(slots, pieces * rank, k, device=dev, dtype=dtype) / k ** 0.5
        b = torch.randn(slots, n, rank, device=dev, dtype=dtype) * 0.02
        token_slots = torch.arange(tokens, device=dev) % mix
        meta = reference_lora.meta_of(token_slots, slots)
        y = kernels.linear(x, w)
        got = kernels.lora_add(y.clone(), x, a, b, meta, slices)
        ref = reference_lora.lora_add(y.float().clone(), x.float(), a.float(), b.float(), meta, slices)
        torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)
        base_us = _graph_us(lambda: kernels.linear(x, w))
        lora_us = _graph_us(lambda: kernels.lora_add(y, x, a, b, meta, slices))
        row[proj] = {"base_us": round(base_us, 2), "lora_us": round(lora_us, 2)}
        if tokens <= triton_lora.FUSED_MAX_TOKENS:   # the one-launch kernel it replaced, beside it
            row[proj]["fused_us"] = round(_graph_us(
                lambda: triton_lora.lora_fused(y, x, a, b, meta, slices)), 2)
        if tokens <= 16:   # the projection with its update, as the decode runs them
            sync = torch.zeros(2, dtype=torch.int32, device=dev)
            one = kernels.lora_linear(x, w, None, a, b, meta, slices, sync)
            torch.testing.assert_close(one.float(), got.float(), atol=0.1, rtol=0.05)
            row[proj]["one_launch_us"] = round(_graph_us(
                lambda: kernels.lora_linear(x, w, None, a, b, meta, slices, sync)), 2)
            total_one += row[proj]["one_launch_us"]
        total_base += base_us
        total_lora += lora_us
    layers = cfg["num_hidden_layers"]
    row.update(layer_base_us=round(total_base, 1), layer_lora_us=round(total_lora, 1),
               step_lora_ms=round(total_lora * layers / 1e3, 3),
               step_projections_ms=round(total_base * layers / 1e3, 3))
    if total_one:
        row["step_one_launch_ms"] = round(total_one * layers / 1e3, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b,llama-3.1-8b", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", default="1,16,64,256,2048")
    ap.add_argument("--mix", default="1,8", help="adapters the tokens are dealt over")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=16, help="device slots (--max-loras)")
    args = ap.parse_args()
    rows = [measure(m, int(t), int(k), args) for m in args.model.split(",")
            for t in args.tokens.split(",") for k in args.mix.split(",") if int(k) <= int(t)]
    print(f"{'model':14} {'tokens':>6} {'adapters':>8} {'proj ms/step':>12} {'LoRA ms/step':>12} {'ratio':>6}"
          f" {'one launch ms/step':>18} {'ratio':>6}")
    for r in rows:
        one = r.get("step_one_launch_ms")
        print(f"{r['model']:14} {r['tokens']:>6} {r['adapters']:>8} {r['step_projections_ms']:>12} "
              f"{r['step_lora_ms']:>12} {r['step_lora_ms'] / r['step_projections_ms']:>6.2f}"
              + (f" {one:>18} {one / r['step_projections_ms'] - 1:>6.2f}" if one else ""))
    print(json.dumps({"bench": "lora_kernels", "rows": rows}))


if __name__ == "__main__":
    main()
