"""CUDA graphs of a constrained step's late sampling (``ModelRunner.sample_late``). One replay
uploads the step's token bitmasks and sampling arrays from a static pinned buffer, applies the
masks to the logits, runs the race, writes the new tokens into ``last_token`` and copies them
to the host.

Why: a step sent with ``bitmask_follows`` has finished its forward pass 1.0-1.8 ms before its
bitmasks come (H200, Qwen3-0.6B). From their arrival to the sampled ids, the device waits for
the host. Done eagerly, that host work cost 0.7-1.0 ms a token in session 15's probe:
packing the arrays into a pinned buffer (0.07 ms), the copy and its typed views (0.13), the
mask and race kernels' Triton launches (0.08 and 0.12), the scatter and the download. Replayed,
the host writes the step's arrays into numpy views of the static buffer (a few µs each) and
launches one graph.

One graph per key (rows bucket, masks bucket, filters):
- rows and distinct masks are rounded up to powers of two. Padded rows are greedy and
  unmasked, and write their token into ``last_token``'s sink slot (its last);
- filters are those ``sampler.device_arrays`` names (top-k/top-p, min-p).

A key's graph is captured at its first step, after that step is run eagerly over the same
buffers (which compiles the kernels and gives the step its tokens). All graphs share one
memory pool (no two run at once), which keeps the largest key's intermediates for good: a
top-k/top-p step of 256 rows sorts [256, vocab] float32 logits with int64 indices, ~0.5 GB for
a 151,936-token vocabulary, as much as the eager sampler's peak that the caching allocator
keeps too (neither is counted when the KV cache is sized). Capture errors are
``thread_local``: the worker's other threads keep using the device meanwhile.

Steps it does not take go to ``sampler.sample`` as before: rows with penalties (their
histories are Python lists) or logprobs, speculative verifies, more rows or masks than the
static logits hold, logits of another dtype. The runner builds none under tensor parallelism
(the ids' broadcast) or without step graphs. Off CUDA (tests) a stand-in replays by running
the same code over the same buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from headrace import kernels
from headrace.dataplane import staging
from headrace.dataplane.cuda_graphs import capture_graph
from headrace.dataplane.sampler import SampleOutput, SamplingBatch, apply_filters


def _bucket(n: int, cap: int) -> int:
    """``n`` rounded up to a power of two, at most ``cap``."""
    return min(1 << max(0, n - 1).bit_length(), cap)


def over_step_graphs(decode, mixed, last_token: torch.Tensor) -> "LateSampler | None":
    """A ``LateSampler`` over the static logits of the decode graphs (else the mixed step
    graphs'); None without step graphs (``--enforce-eager``, a CPU worker)."""
    logits = getattr(decode if decode is not None else mixed, "logits", None)
    return LateSampler(logits, last_token) if logits is not None else None


class _StandIn:
    """A CUDA graph's stand-in off CUDA: ``replay`` runs the captured code again."""

    def __init__(self, run):
        self.replay = run


class LateSampler:
    """Late sampling through graphs over ``logits`` (the step graphs' static [rows, vocab]
    buffer) into ``last_token`` (by sequence row; its last slot is padding's sink)."""

    def __init__(self, logits: torch.Tensor, last_token: torch.Tensor):
        self.logits, self.last_token = logits, last_token
        self.device = logits.device
        self.max_rows, vocab = logits.shape
        self.words = (vocab + 31) // 32
        self.sink = last_token.shape[0] - 1
        self.graphs: dict[tuple, tuple] = {}   # key -> (graph, its buffers' views: ``_views``)
        self.pool = None
        self.num_replays = 0
        cuda = self.device.type == "cuda"
        _, capacity = staging.layout_of(self._template(self.max_rows, self.max_rows, True, True))
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=cuda)
        self._dev = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self._host_tokens = torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=cuda)
        self._rows = torch.arange(self.max_rows, dtype=torch.int64, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._uploaded: torch.cuda.Event | None = None   # the last replay's upload has run

    def takes(self, logits: torch.Tensor, sampling: SamplingBatch, verify: bool,
              masks: dict[str, np.ndarray]) -> bool:
        """Whether a graph samples this step (else ``sampler.sample`` does)."""
        return (not verify and not sampling.penalized and not sampling.logprobs.any()
                and 0 < logits.shape[0] <= self.max_rows and logits.dtype == self.logits.dtype
                and logits.shape[1] == self.logits.shape[1]
                and len(masks.get("s_mask_bits", ())) <= self.max_rows)

    def sample(self, logits: torch.Tensor, host: dict[str, np.ndarray],
               masks: dict[str, np.ndarray]) -> SampleOutput:
        """The step's tokens: ``host``, the step's uploaded arrays (its ``s_`` sampling arrays,
        ``last_rows`` or ``sample_rows``), ``masks``, ``bitmasks.arrays``'. The tokens are in
        ``last_token`` and on their way to the host when this returns."""
        n = logits.shape[0]
        bits = masks.get("s_mask_bits", np.zeros((0, self.words), np.int32))
        key = (_bucket(n, self.max_rows), _bucket(len(bits), self.max_rows),
               "s_top_k" in host, "s_min_p" in host)
        if self._uploaded is not None:
            self._uploaded.synchronize()   # (long done: the step before's result was read)
        entry = self.graphs.get(key)
        views = entry[1] if entry is not None else self._views(key)
        self._fill(views, n, host, bits, masks)
        if logits.data_ptr() != self.logits.data_ptr() or logits.stride() != self.logits.stride():
            self.logits[:n].copy_(logits)   # (an eager forward's logits)
        if entry is None:
            self.graphs[key] = (self._capture(key, views), views)
        else:
            entry[0].replay()
            self.num_replays += 1
        if self._stream is not None:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return SampleOutput(self._tokens[:n], None, None, None, [], _host=[self._host_tokens[:n], None, None, None])

    def _template(self, rows: int, masks: int, top_k_p: bool, min_p: bool) -> dict[str, np.ndarray]:
        """The arrays a key's graph uploads, by name (zeros of their shapes)."""
        out = {"bits": np.zeros((masks, self.words), np.int32), "mask_of": np.zeros(rows, np.int32),
               "race_temp": np.zeros(rows, np.float32), "seeds": np.zeros(rows, np.int64),
               "counters": np.zeros(rows, np.int64), "rows": np.zeros(rows, np.int64)}
        if top_k_p or min_p:
            out["temp"] = np.zeros(rows, np.float32)
        if top_k_p:
            out.update(top_k=np.zeros(rows, np.int64), top_p=np.zeros(rows, np.float32))
        if min_p:
            out["min_p"] = np.zeros(rows, np.float32)
        return out

    def _views(self, key: tuple) -> dict:
        template = self._template(*key)
        layout, total = staging.layout_of(template)
        host = staging.views_of(template, layout, self._host)
        dev = staging.views_of(template, layout, self._dev)
        return {"host": {k: v.numpy() for k, v in host.items()}, "dev": dev, "bytes": total,
                "rows": key[0]}

    def _fill(self, views: dict, n: int, host: dict[str, np.ndarray], bits: np.ndarray,
              masks: dict[str, np.ndarray]) -> None:
        """Writes the step's arrays into the static pinned buffer; padded rows sample greedily,
        unmasked and unfiltered, into the sink."""
        h = views["host"]
        h["bits"][:len(bits)] = bits
        mask_of = h["mask_of"]
        mask_of.fill(-1)
        if "s_mask_rows" in masks:
            mask_rows = masks["s_mask_rows"]
            mask_of[mask_rows] = masks["s_mask_of"] if "s_mask_of" in masks else np.arange(len(mask_rows))
        rows = host["sample_rows"] if "sample_rows" in host else host["last_rows"]
        for name, source, pad in (("race_temp", host["s_race_temp"], 0), ("seeds", host["s_seeds"], 0),
                                  ("counters", host["s_counters"], 0), ("rows", rows, self.sink),
                                  ("temp", host.get("s_temp"), 1), ("top_k", host.get("s_top_k"), 0),
                                  ("top_p", host.get("s_top_p"), 1), ("min_p", host.get("s_min_p"), 0)):
            if name in h:
                h[name][:n], h[name][n:] = source, pad

    def _run(self, views: dict) -> None:
        """The key's work over the static buffers (what its graph holds)."""
        b, d = views["rows"], views["dev"]
        self._dev[:views["bytes"]].copy_(self._host[:views["bytes"]], non_blocking=True)
        logits = self.logits[:b]
        kernels.apply_token_bitmask(logits, d["bits"], self._rows[:b], d["mask_of"])
        if "temp" in d:
            logits = apply_filters(logits.float(), d)
        tokens = kernels.sample_race(logits, d["race_temp"], d["seeds"], d["counters"])
        self.last_token.index_copy_(0, d["rows"], tokens)
        self._tokens[:b].copy_(tokens)
        self._host_tokens[:b].copy_(self._tokens[:b], non_blocking=True)

    def _capture(self, key: tuple, views: dict):
        """Runs the key's first step eagerly, then captures its graph (on CUDA)."""
        self._run(views)
        if self._stream is None:
            return _StandIn(lambda: self._run(views))
        torch.cuda.synchronize(self.device)
        graph = capture_graph(lambda: self._run(views), self.pool, self._stream, error_mode="thread_local")
        self.pool = graph.pool() if self.pool is None else self.pool
        return graph
