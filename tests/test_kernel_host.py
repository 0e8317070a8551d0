"""headrace.kernels.host: the launchers' integer helpers give Triton's own results (they replace
``triton.next_power_of_2`` / ``triton.cdiv``, ~3-4 µs of host time per call in Triton 3.5+)."""

from __future__ import annotations

import pytest

from headrace.kernels.host import cdiv, next_pow2

triton = pytest.importorskip("triton")


def test_next_pow2_and_cdiv_equal_tritons():
    for n in list(range(0, 1100)) + [4095, 4096, 4097, 151936, 2**31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 64, 128, 256):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
