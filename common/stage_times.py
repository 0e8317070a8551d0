"""Timestamps of a request's first-token path, for benchmarks (``bench.first_token``): off unless
``HEADRACE_STAGE_TIMES`` names a directory, and then each process of the control plane (API front
end, engine core, or both in one) appends ``monotonic-seconds <TAB> key <TAB> stage <TAB> JSON``
lines to ``DIR/stages-<pid>.tsv``: per request (key = its request id) when the front end has it,
has tokenized and submitted it, when the core has it, has folded its first token and flushed it
to the front end, and when the front end hands that token to the client's stream; per step (key =
``step:<id>``) when the core scheduled it, sent it, and had its result back, with the data
plane's own figures (execute, device, sample and idle milliseconds), when it folded the step's
tokens and, for a step sent with ``bitmask_follows``, when it began filling its late bitmasks and
sent them. The data plane's workers stamp steps too (``bench.late_mask_hops`` reads them): when
a message is read (``w_read``, ``w_late``), a step launched, sampled on its late bitmasks, waited
for, and its answer yielded and written. ``time.monotonic()`` is one clock for every process of
a host (CLOCK_MONOTONIC), so stamps of different processes subtract.

Off, it costs nothing: ``STAGES`` is None and every call site is ``if STAGES is not None``.
Lines are written through a line-buffered file (one ``write`` each, whole lines from one process
never interleave) so a process that is killed leaves what it stamped."""

from __future__ import annotations

import json
import os
import time

ENV = "HEADRACE_STAGE_TIMES"


class StageLog:
    def __init__(self, directory: str):
        self.directory = directory
        self._file = None   # opened by the first stamp (a process that stamps nothing writes nothing)

    def stamp(self, key: str, stage: str, at: float | None = None, **values) -> None:
        """``key`` reached ``stage`` now (or at ``at``, a ``time.monotonic()`` instant)."""
        t = time.monotonic() if at is None else at
        if self._file is None:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"stages-{os.getpid()}.tsv")
            self._file = open(path, "a", buffering=1, encoding="utf-8")   # noqa: SIM115
        self._file.write(f"{t:.6f}\t{key}\t{stage}\t{json.dumps(values) if values else ''}\n")


def from_env() -> StageLog | None:
    directory = os.environ.get(ENV)
    return StageLog(directory) if directory else None


STAGES: StageLog | None = from_env()


def read(directory: str) -> list[tuple[float, str, str, dict]]:
    """Every stamp written under ``directory``, oldest first."""
    rows = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("stages-") and name.endswith(".tsv")):
            continue
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    rows.append((float(parts[0]), parts[1], parts[2], json.loads(parts[3]) if parts[3] else {}))
    rows.sort(key=lambda r: r[0])
    return rows
