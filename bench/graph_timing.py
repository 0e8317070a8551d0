"""Times GPU work the way decode runs in the engine: replayed from one CUDA graph."""

from __future__ import annotations

import torch


def graph_ms(calls, replays: int = 10) -> float:
    """Milliseconds per call when the calls replay from one CUDA graph (no launch overhead);
    when their inputs differ (distinct weights or batches), the L2 cache cannot serve repeats."""
    for call in calls:
        call()  # compiles, sets up the library
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_ms(graph, replays) / len(calls)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 10) -> float:
    """Milliseconds per replay of a captured graph (after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
