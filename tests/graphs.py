"""CUDA graphs on a worker that has none (a CPU worker): the worker's own ``WorkerGraphs`` of a
``--cudagraph-mode``, built and captured as the worker does on a GPU; off CUDA every graph is
a stand-in (``cuda_graphs.EagerGraph``, ``mixed_graphs.EagerPiece``) replaying over the same
static buffers, so the tests exercise the buffer logic, padding and dispatch."""

from __future__ import annotations

from headrace.dataplane.graph_capture import WorkerGraphs, capture_tokens
from headrace.dataplane.spec_decode import graph_rows


def attach(worker, mode: str = "full_and_piecewise") -> WorkerGraphs:
    """The worker's graphs of ``mode`` (a worker that captured its own keeps them)."""
    runner = worker.runner
    if runner.graphs is not None or runner.mixed is not None:
        return worker.graphs
    graphs = WorkerGraphs(mode, runner.model, runner.device,
                          graph_rows(worker.speculative, worker.opts.max_num_seqs),
                          runner.batch.max_blocks, capture_tokens(worker.opts))
    graphs.capture(runner.kv_caches)
    worker.graphs, runner.graphs, runner.mixed = graphs, graphs.decode, graphs.mixed
    if runner.draft is not None and runner.draft.graphs is None and graphs.decode is not None:
        runner.draft.capture_graphs(graphs.decode.max_batch, runner.batch.max_blocks)
    return graphs


def record_modes(runner) -> list[tuple[str, str]]:
    """(kind, graph) of every step the runner launches from now on."""
    seen, launch = [], runner.launch

    def recording(step):
        launched = launch(step)
        seen.append((launched.kind, launched.graph))
        return launched

    runner.launch = recording
    return seen
