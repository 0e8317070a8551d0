"""Where a test module's Triton kernels run: compiled on a CUDA GPU (HEADRACE_TEST_DEVICE=cuda
or any visible GPU), else under Triton's CPU interpreter, which reads TRITON_INTERPRET=1 only
at triton's first import, so ``triton_device()`` must run before the module imports triton."""

from __future__ import annotations

import os
import sys

import pytest
import torch


def triton_device() -> str:
    """"cuda" or "cpu" (interpreted); skips the calling module when triton is missing or was
    imported earlier without the interpreter."""
    device = "cuda" if (os.environ.get("HEADRACE_TEST_DEVICE", "").startswith("cuda")
                        or torch.cuda.is_available()) else "cpu"
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported earlier without TRITON_INTERPRET=1; its CPU interpreter "
                        "needs the variable before the first import", allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason="triton is not installed: no Triton kernels to test")
    return device
