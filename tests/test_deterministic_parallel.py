"""Tensor parallelism under ``--deterministic`` (gloo, three CPU ranks): the row-parallel
layers' all-reduce adds the ranks' partial sums in rank order, so every rank gets the same
bits, which are those of ((p0 + p1) + p2) whatever the message size; without the mode it is the
backend's own reduction."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    from headrace.dataplane import parallel
    from headrace.kernels import batch_invariant

    parallel.init(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
    parts = {r: torch.randn(7, 33, generator=torch.Generator().manual_seed(r)) for r in range(world)}
    mine = parts[rank].clone()
    with batch_invariant.enabled():
        summed = parallel.all_reduce(mine)
    expected = (parts[0] + parts[1]) + parts[2]
    out[rank] = bool(torch.equal(summed, expected)) and summed is mine
    dist.destroy_process_group()


@pytest.mark.slow   # three spawned ranks, each importing torch
def test_the_deterministic_all_reduce_sums_in_rank_order_on_every_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_rank, args=(3, port, out), nprocs=3, join=True)
    assert dict(out) == {0: True, 1: True, 2: True}
