"""Probe (GPU only, not a test): does a decode step get faster when its batch is split in two
halves whose forward passes run on two CUDA streams, so one half's memory-bound attention can
overlap the other half's projections? Times CUDA-graph replays of the whole decode forward
(+ LM head) of a checkpoint, serial against two streams, at W1-like batch and context.

    python -P bench/overlap_probe.py /tmp/qwen3
"""

from __future__ import annotations

import sys

import torch

from dataplane import kv_cache
from dataplane.config import load_model_config
from dataplane.loader import load_model
from dataplane.model import AttentionMetadata
from graph_timing import replay_ms

BLOCK = 16


def inputs(batch: int, ctx: int, width: int, num_blocks: int, dev) -> dict:
    perm = torch.randperm(num_blocks, device=dev)[:batch * width].to(torch.int32)
    tables = perm.view(batch, width)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
    slots = tables[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK
    return dict(ids=torch.randint(0, 1000, (batch,), device=dev), pos=pos, slots=slots,
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
                qsl=torch.arange(batch + 1, dtype=torch.int32, device=dev), tables=tables)


def forward(model, caches, x: dict, lo: int, hi: int) -> torch.Tensor:
    meta = AttentionMetadata(slot_mapping=x["slots"][lo:hi], query_start_loc=x["qsl"][:hi - lo + 1],
                             seq_lens=x["seq_lens"][lo:hi], block_tables=x["tables"][lo:hi],
                             max_query_len=1, decode_only=True)
    return model.logits(model(x["ids"][lo:hi], x["pos"][lo:hi], caches, meta))


@torch.inference_mode()
def main() -> None:
    path = sys.argv[1]
    dev = torch.device("cuda")
    cfg = load_model_config(path)
    model = load_model(path, cfg, dev, torch.bfloat16, 4096)
    num_blocks = 12_000   # the largest point below needs 256 x 44 blocks
    caches = kv_cache.allocate(cfg, num_blocks, BLOCK, torch.bfloat16, dev)
    for c in caches:
        c.normal_()
    side = torch.cuda.Stream(dev)
    print("batch  ctx   serial_ms  two_streams_ms  gain")
    for batch, ctx in ((256, 700), (192, 800), (128, 1000), (64, 1000), (32, 1500)):
        x = inputs(batch, ctx, -(-ctx // BLOCK), num_blocks, dev)
        half = batch // 2
        forward(model, caches, x, 0, batch)
        torch.cuda.synchronize()
        serial = torch.cuda.CUDAGraph()
        with torch.cuda.graph(serial):
            forward(model, caches, x, 0, batch)
        forward(model, caches, x, 0, half)
        torch.cuda.synchronize()
        split = torch.cuda.CUDAGraph()
        with torch.cuda.graph(split):
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            forward(model, caches, x, 0, half)
            with torch.cuda.stream(side):
                forward(model, caches, x, half, batch)
            main_stream.wait_stream(side)
        a, b = replay_ms(serial, 20), replay_ms(split, 20)
        print(f"{batch:5d} {ctx:5d} {a:10.3f} {b:14.3f} {100 * (a - b) / a:5.1f}%")


if __name__ == "__main__":
    main()
