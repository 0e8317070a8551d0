"""Acceptance of a draft model under greedy speculative verification, measured on a CPU.

The target (default: the embedded ``tiny`` model) greedily generates ``--new-tokens`` tokens
after each of ``--prompts`` prompts of 32..128 tokens cut at paragraph starts from the
held-out last three chapters of ``corpus.txt`` (``train.py`` never trains on them). The run
is then replayed as ``method: draft_model`` would run it with ``k`` drafts: at each verify
point the draft greedily proposes k tokens from the current (target-generated) context, the
leading drafts equal to the target's greedy tokens are accepted, and the target's pass adds
one token more (the correction, or the bonus token when all k are accepted). Reported per
draft: verify passes, mean accepted per verify, acceptance rate (accepted / drafted), the
fraction of verifies accepting position 1..k, and tokens per target pass (mean accepted + 1).
Rows: the trained draft (``tiny-draft``), the target as its own draft (must be 100%), and a
draft of the trained draft's architecture with random weights (near 0%). fp32, transformers.

    python -m bench.draft_acceptance [--target DIR] [--draft DIR] [--prompts 64] [--k 4]
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import random
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaForCausalLM

from headrace.dataplane.default_model import default_draft_model_dir, default_model_dir, train

# transformers >= 5.2x names the forward's cache argument ``cache``; earlier 5.x ``past_key_values``.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def step(model, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Feed ``ids`` (appending to ``cache``) and return the greedy next token, shape [1, 1]."""
    return model(input_ids=ids, use_cache=True, **{CACHE_ARG: cache}).logits[:, -1:].argmax(-1)


def held_out_prompts(model_dir: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` tokens: ``<s>`` then held-out text from a paragraph start."""
    tokenizer = train.load_tokenizer(pathlib.Path(model_dir))
    chapters = train.read_chapters(default_model_dir().parent / "corpus.txt")[-3:]
    stream, starts = train.encode_chapters(tokenizer, chapters)
    starts = [s for s in starts if s + hi <= len(stream)]
    rng = random.Random(seed)
    return [[train.BOS_ID] + stream[s:s + rng.randint(lo, hi) - 1] for s in rng.sample(starts, n)]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's ``n`` greedy tokens after ``prompt`` (EOS does not stop it)."""
    cache, ids, out = DynamicCache(), torch.tensor([prompt]), []
    for _ in range(n):
        ids = step(model, ids, cache)
        out.append(ids.item())
    return out


@torch.no_grad()
def replay(draft, prompt: list[int], target: list[int], new_tokens: int, k: int) -> list[int]:
    """Accepted drafts per verify pass when ``draft`` speculates for the target run ``target``
    (``new_tokens`` generated tokens plus k spare ones, so every pass has k references).
    The draft's KV cache is kept and cropped to what verification accepted, as a server would."""
    cache, accepted, i = DynamicCache(), [], 0
    while i < new_tokens:
        context = prompt + target[:i]
        ids, proposal = torch.tensor([context[cache.get_seq_length():]]), []
        for _ in range(k):
            ids = step(draft, ids, cache)
            proposal.append(ids.item())
        a = 0
        while a < k and proposal[a] == target[i + a]:
            a += 1
        accepted.append(a)
        # The cache holds context + proposal[:k-1]; keep context + the accepted drafts.
        if (drop := k - 1 - min(a, k - 1)) > 0:
            cache.crop(-drop)
        i += a + 1
    return accepted


def linear_macs(model) -> int:
    """Multiply-accumulates per token in the model's linear layers (LM head included)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def summarise(name: str, passes: list[int], k: int) -> dict:
    n = len(passes)
    return {"draft": name, "verifies": n, "mean_accepted": sum(passes) / n,
            "acceptance_rate": sum(passes) / (k * n),
            "per_position": [sum(a >= j for a in passes) / n for j in range(1, k + 1)],
            "tokens_per_target_pass": sum(a + 1 for a in passes) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(default_model_dir()))
    ap.add_argument("--draft", default=str(default_draft_model_dir()))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    target, draft = load(args.target), load(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if AutoTokenizer.from_pretrained(args.draft).get_vocab() != tokenizer.get_vocab():
        raise SystemExit("the draft's tokenizer differs from the target's")
    torch.manual_seed(args.seed)
    random_draft = LlamaForCausalLM(draft.config).float().eval()
    prompts = held_out_prompts(args.target, args.prompts, args.min_len, args.max_len, args.seed)

    start = time.perf_counter()
    runs = [greedy(target, p, args.new_tokens + args.k) for p in prompts]
    print(f"target: {len(prompts)} held-out prompts ({args.min_len}..{args.max_len} tokens, "
          f"mean {sum(map(len, prompts)) / len(prompts):.0f}), {args.new_tokens} greedy tokens each, "
          f"{time.perf_counter() - start:.1f} s")
    rows = []
    for name, model in [("tiny-draft", draft), ("target (sanity)", target), ("random weights", random_draft)]:
        start = time.perf_counter()
        passes = [a for p, r in zip(prompts, runs) for a in replay(model, p, r, args.new_tokens, args.k)]
        row = summarise(name, passes, args.k)
        row["draft_macs_per_token"] = linear_macs(model)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
    print(f"k = {args.k}; target {linear_macs(target):,} linear MACs/token, "
          f"draft {linear_macs(draft):,} (1/{linear_macs(target) / linear_macs(draft):.1f})")
    head = f"{'draft':<16} {'verifies':>8} {'accepted/verify':>15} {'rate':>7}  " + " ".join(
        f"{'pos' + str(j):>6}" for j in range(1, args.k + 1)) + f" {'tokens/pass':>11}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['draft']:<16} {r['verifies']:>8} {r['mean_accepted']:>15.3f} {r['acceptance_rate']:>7.1%}  "
              + " ".join(f"{x:>6.1%}" for x in r["per_position"]) + f" {r['tokens_per_target_pass']:>11.3f}")
    print(json.dumps({"k": args.k, "prompts": len(prompts), "new_tokens": args.new_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
