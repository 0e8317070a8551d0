"""Plain-integer twins of Triton's host helpers, for the launch code of every Triton kernel here.

Why: since Triton 3.5 ``triton.next_power_of_2`` and ``triton.cdiv`` are ``ConstexprFunction``
wrappers (they unwrap constexpr arguments on every call) costing ~3-4 µs of host time each,
against ~0.05 µs for the integer arithmetic; an eager step of a 28-layer model calls them
~300 times (grids and tile sizes of the norms, the prologue, attention, the skinny GEMMs),
~1 ms of host time per step, and every piecewise step ~4 per layer between its graphs. On the
H200 the host is what such steps wait for (``bench/step_host.py``), so the launchers use these.
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b, as ``triton.cdiv``."""
    return -(-a // b)
