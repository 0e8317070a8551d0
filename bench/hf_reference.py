"""transformers on the same GPU, as the reference for W1: static `generate` (sdpa, batch 64) on
W1's first 64 prompts, sampling at temperature 0.6, ignoring EOS.

    python -m bench.hf_reference MODEL_DIR [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from bench.serving_bench import w1_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    prompts = [p for p, _, _ in w1_requests()[:args.batch]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):     # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kw)   # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                         min_new_tokens=args.new_tokens, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    print(json.dumps({"workload": "w1-transformers", "batch": len(prompts), "new_tokens": args.new_tokens,
                      "output_tokens": tokens, "wall_s": round(wall, 2),
                      "output_tok_per_s": round(tokens / wall, 1)}), flush=True)


if __name__ == "__main__":
    main()
