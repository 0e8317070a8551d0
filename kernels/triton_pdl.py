"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

On Hopper a kernel launched with PDL may be scheduled before the kernel ahead of it in the
stream has finished; it must then wait (``griddepcontrol.wait``) before it touches memory the
earlier kernel may write or read. Every Triton kernel of the hot path calls
``wait_for_predecessor`` first thing, so its semantics are a plain stream order, while its
launch, block scheduling and set-up overlap the previous kernel's tail (a decode layer is ~10
latency-bound kernels; bench/pdl_probe.py measured ~0.5 µs per boundary).

``HEADRACE_PDL=0`` turns it off. It is off under Triton's CPU interpreter and before Hopper.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = triton.knobs.runtime.interpret
_ENABLED = os.environ.get("HEADRACE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (and must pass PDL=True)."""
    if not _ENABLED or _INTERPRETED or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a Triton launch: the PDL constexpr and the launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Waits until the previous kernel in the stream has finished and its writes are visible,
    then lets the next kernel launch (it will wait the same way)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
