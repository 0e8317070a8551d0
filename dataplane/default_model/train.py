"""Train the tiny embedded default model that ``headrace serve`` uses with no arguments.

What it does
------------
1. Reads ``corpus.txt`` next to this file: Jane Austen's *Pride and Prejudice*
   (public domain; provenance in ``CORPUS.md``). Hard-wrapped lines are
   joined so that each paragraph is one line; paragraphs are separated by a
   blank line, chapters are treated as documents.
2. Trains a byte-level BPE tokenizer (HF ``tokenizers``, vocab 2048, special
   tokens ``<s>`` = 0 and ``</s>`` = 1). Words carry their *trailing* space
   ("The " is one piece), so prompts that end in a space, like "The ", are
   in-distribution. Encoding prepends ``<s>``; decoding round-trips bytes.
   With ``--tokenizer DIR`` it instead reuses ``DIR``'s ``tokenizer.json`` and
   ``tokenizer_config.json`` (copied byte for byte; the vocab is the
   tokenizer's), which is how the draft model ``tiny-draft/`` shares the
   target's tokenizer exactly.
3. Trains a tiny ``LlamaForCausalLM`` (GQA, tied embeddings) from scratch on
   CPU with AdamW (fp32 weights, bf16 autocast) for a fixed wall-clock budget
   (or, with ``--steps``, a fixed number of steps, whichever ends first).
   Every training window starts with ``<s>`` at a paragraph boundary; each
   chapter ends with ``</s>``. The corpus is tiny (~0.2M tokens), so residual
   dropout is used and the weights with the lowest loss on the held-out last
   three chapters are kept.
4. Saves a Hugging Face model directory to ``--out`` (``config.json``,
   ``model.safetensors`` in bfloat16, ``generation_config.json``,
   ``tokenizer.json``, ``tokenizer_config.json``), reloads it from disk and
   prints a greedy and a temperature-0.8 continuation of "The ".

How to rerun
------------
    python dataplane/default_model/train.py              # ~12 minutes
    python dataplane/default_model/train.py --minutes 1  # quick smoke run
    # the speculative-decoding draft (tiny-draft/, same tokenizer; see CORPUS.md)
    python dataplane/default_model/train.py --tokenizer dataplane/default_model/tiny \
        --out dataplane/default_model/tiny-draft --hidden 128 --layers 3 \
        --heads 2 --kv-heads 1 --intermediate 256 --steps 1500 --minutes 30   # ~14 minutes

Needs torch, transformers and tokenizers; runs on 2 CPU threads (``--threads``).
The seed is fixed, but the learning-rate schedule follows wall-clock time, so
the exact weights depend on machine speed (with ``--steps`` they do not, as
long as the steps run out before the minutes do).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1
MAX_POSITIONS = 1024
# A plain-text chat format ("User: ...\nAssistant:") so chat requests work out of the box.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{% if message.role == 'system' %}{{ message.content | trim }}\n\n"
                 "{% else %}{{ message.role | capitalize }}: {{ message.content | trim }}\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
# Pre-token pattern: a word, a contraction suffix, up to 3 digits or a run of
# punctuation, each with at most one trailing space; other whitespace alone.
PIECES = r"'(?:s|t|re|ve|m|ll|d) ?|\p{L}+ ?|\p{N}{1,3} ?|[^\s\p{L}\p{N}]+ ?|\s+"


def read_chapters(path: Path) -> list[list[str]]:
    """Return chapters as lists of paragraphs (each paragraph unwrapped to one line)."""
    chapters: list[list[str]] = [[]]
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
        para = " ".join(block.split())
        if not para:
            continue
        if re.fullmatch(r"Chapter \d+", para) and chapters[-1]:
            chapters.append([])
        chapters[-1].append(para)
    return chapters


def train_tokenizer(paragraphs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PIECES), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p + "\n\n" for p in paragraphs), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


def encode_chapters(tok: Tokenizer, chapters: list[list[str]]) -> tuple[list[int], list[int]]:
    """Token stream (chapter tokens + </s> per chapter) and the paragraph start offsets."""
    stream: list[int] = []
    starts: list[int] = []
    for chapter in chapters:
        encs = tok.encode_batch([p + "\n\n" for p in chapter], add_special_tokens=False)
        for enc in encs:
            starts.append(len(stream))
            stream.extend(enc.ids)
        stream.append(EOS_ID)
    return stream, starts


def load_tokenizer(src: Path) -> Tokenizer:
    """Reuse a tokenizer saved by this script (``src/tokenizer.json``), checking its specials."""
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID, src
    return tok


def make_model(vocab_size: int, hidden: int, layers: int, heads: int = 4, kv_heads: int = 2,
               intermediate: int | None = None) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate or int(round(hidden * 2.6875 / 16) * 16),  # 256 -> 688
        max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, initializer_range=0.02)
    return LlamaForCausalLM(config)


def add_dropout(model: LlamaForCausalLM, p: float) -> None:
    """Dropout on the embeddings and on each residual branch, active only in train mode.

    Llama has no residual dropout of its own; with ~0.2M training tokens it is
    what keeps the model from memorising the book. Forward hooks leave the saved
    model a plain LlamaForCausalLM.
    """
    def hook(module, inputs, output):
        return torch.nn.functional.dropout(output, p, module.training)
    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)


def batch(stream: torch.Tensor, starts: list[int], size: int, seq_len: int, rng: random.Random):
    """Random windows of seq_len tokens, each ``<s>`` followed by text from a paragraph start."""
    rows = []
    for i in rng.choices(starts, k=size):
        rows.append(torch.cat([torch.tensor([BOS_ID]), stream[i:i + seq_len - 1]]))
    return torch.stack(rows)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, max_windows: int = 32) -> float:
    model.eval()
    n = min(max_windows, (len(stream) - 1) // (seq_len - 1))
    x = torch.stack([torch.cat([torch.tensor([BOS_ID]), stream[k * (seq_len - 1):(k + 1) * (seq_len - 1)]])
                     for k in range(n)])
    loss = model(input_ids=x.to(model.device), labels=x.to(model.device)).loss.item()
    model.train()
    return loss


def lr_at(step: int, frac: float, peak: float, warmup: int) -> float:
    """Linear warmup over steps, then cosine decay to 10% over the budget (``frac`` of it spent)."""
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=12.0, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, help="also stop after this many steps (the schedule follows "
                    "whichever budget is spent faster): reproducible on a busy machine")
    ap.add_argument("--corpus", type=Path, default=HERE / "corpus.txt")
    ap.add_argument("--out", type=Path, default=HERE / "tiny")
    ap.add_argument("--tokenizer", type=Path, metavar="DIR",
                    help="reuse DIR's tokenizer.json / tokenizer_config.json instead of training one")
    ap.add_argument("--vocab", type=int, help="tokenizer vocab to train (default 2048)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden / heads)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, help="MLP width (default ~2.69 x hidden: 688 at 256)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (1 on a shared machine)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a larger model (e.g. a target for tiny-draft)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    chapters = read_chapters(args.corpus)
    if args.tokenizer:
        if args.tokenizer.resolve() == args.out.resolve():
            ap.error("--tokenizer DIR must not be --out (that directory is replaced)")
        tok = load_tokenizer(args.tokenizer)
        if args.vocab not in (None, tok.get_vocab_size()):
            ap.error(f"--vocab {args.vocab} != {args.tokenizer}'s vocab {tok.get_vocab_size()}")
    else:
        tok = train_tokenizer([p for ch in chapters for p in ch], args.vocab or 2048)
    train_ch, val_ch = chapters[:-3], chapters[-3:]  # last three chapters held out
    train_ids, starts = encode_chapters(tok, train_ch)
    val_ids, _ = encode_chapters(tok, val_ch)
    train_stream, val_stream = torch.tensor(train_ids), torch.tensor(val_ids)
    starts = [s for s in starts if s + args.seq_len <= len(train_ids)]
    n_bytes = sum(len(p) + 2 for ch in chapters for p in ch)
    print(f"corpus: {len(chapters)} chapters, {n_bytes} bytes, {len(train_ids) + len(val_ids)} tokens "
          f"({n_bytes / (len(train_ids) + len(val_ids)):.2f} bytes/token), vocab {tok.get_vocab_size()}")

    model = make_model(tok.get_vocab_size(), args.hidden, args.layers, args.heads, args.kv_heads,
                       args.intermediate)
    add_dropout(model, args.dropout)
    model.to(args.device)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters\n{model.config}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    budget = args.minutes * 60.0
    t0 = last_log = time.monotonic()
    step, ema, best_val, best_state = 0, None, float("inf"), None
    model.train()

    def spent() -> float:  # the fraction of the budget used: wall clock, or steps if sooner
        return max((time.monotonic() - t0) / budget, step / args.steps if args.steps else 0.0)

    while (frac := spent()) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, frac, args.lr, warmup=50)
        x = batch(train_stream, starts, args.batch, args.seq_len, rng).to(args.device)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):  # ~2x on bf16 CPUs
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if time.monotonic() - last_log > 30 or step == 1 or spent() >= 1.0:
            last_log = time.monotonic()
            val = evaluate(model, val_stream, args.seq_len)
            if val < best_val:  # keep the weights that do best on the held-out chapters
                best_val, best_step = val, step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(f"step {step:5d}  {(time.monotonic() - t0) / 60:5.1f} min  loss {ema:.3f}  val {val:.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}", flush=True)
    train_time = time.monotonic() - t0
    model.load_state_dict(best_state)
    print(f"done: {step} steps, {step * args.batch * args.seq_len:,} tokens in {train_time / 60:.1f} min; "
          f"final train loss (EMA, with dropout) {ema:.3f}; keeping step {best_step}, held-out loss {best_val:.3f}")

    # Save in Hugging Face format; weights in bfloat16 to keep the directory small.
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model.to("cpu", torch.bfloat16).save_pretrained(args.out)
    config_path = args.out / "config.json"  # add the flat rope_theta key that other loaders read
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if args.tokenizer:  # byte-identical copies, so a draft and its target tokenize alike
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(args.tokenizer / name, args.out / name)
    else:
        tok.save(str(args.out / "tokenizer.json"))
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                      "pad_token": EOS, "model_max_length": MAX_POSITIONS,
                      "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
        (args.out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {sorted(f.name for f in args.out.iterdir())} to {args.out} ({size / 2**20:.2f} MiB)")

    # Reload from disk and sample, to check that the saved artifacts work.
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    prompt = tokenizer("The ", return_tensors="pt")
    torch.manual_seed(args.seed)
    for name, kwargs in [("greedy", dict(do_sample=False)),
                         ("temperature 0.8", dict(do_sample=True, temperature=0.8, top_k=0, top_p=1.0))]:
        out = model.generate(**prompt, max_new_tokens=80, **kwargs)
        print(f"--- {name} ---\n{tokenizer.decode(out[0], skip_special_tokens=True)}")


if __name__ == "__main__":
    main()
