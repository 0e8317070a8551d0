"""The control plane's part of ``--deterministic`` (docs/determinism.md): the data planes run
batch-invariant kernels (``headrace.kernels.batch_invariant``), so a sequence's tokens depend on its
model, prompt, sampling parameters and seed only, whatever its batch, chunking, prefix-cache
hits, preemptions, data-plane restarts or data-parallel replica; what is left to the control
plane is that every sequence has a seed, and that every data plane it drives runs that mode.

* A request without a seed samples with ``DEFAULT_SEED`` (sample ``index`` of ``n`` with
  ``DEFAULT_SEED + index``, as a seeded request's samples take ``seed + index``): the same
  request gives the same tokens on every run, as SGLang's deterministic mode does. Greedy
  rows ignore it.
* The mode is the data planes' (``WorkerInfo.deterministic``); ``--deterministic`` on the
  control plane demands it of every one of them (a data plane started without it stops the
  engine with a message naming the flag), and with or without it the engine serves in the
  mode every data plane reports (``Engine.deterministic``; Admin ``Config.deterministic``,
  ``GetModelInfo`` and ``/v1/models`` report it).
"""

from __future__ import annotations

from headrace.worker.v1 import worker_pb2 as wpb

DEFAULT_SEED = 0


def check_workers(configured: bool, infos: list[wpb.WorkerInfo]) -> None:
    """ValueError when the data planes disagree on the mode, or ``--deterministic`` is asked
    of a control plane whose data planes were started without it."""
    modes = {bool(i.deterministic) for i in infos}
    if len(modes) > 1:
        raise ValueError("--deterministic: some data planes run it and some do not; start every "
                         "one with the same --deterministic setting")
    if configured and modes != {True}:
        raise ValueError("--deterministic: the data plane was started without it (its kernels "
                         "are not batch-invariant); start it with --deterministic too")


def seed_sampling(sampling: wpb.Sampling) -> None:
    """An unseeded sequence's sampling gets ``DEFAULT_SEED`` (in place)."""
    if not sampling.has_seed:
        sampling.has_seed, sampling.seed = True, DEFAULT_SEED
