"""Shared fixtures: tiny random checkpoints per architecture, running planes over them, TLS
certificates (made with openssl), and NaN-poisoned allocations for the kernel tests."""

from __future__ import annotations

import os

# pytest-xdist's workers share the machine's cores: each computes on its share (on the 2-core CI
# machine, one thread each; two workers of two threads each thrashed, and a worker's spawned
# servers inherit the setting through the environment).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

# Triton reads TRITON_INTERPRET once, at its first import, and any module importing
# transformers imports triton: on a machine without a GPU the interpreter is switched on
# before anything else, so the kernel tests run whatever was collected first.
if not os.environ.get("HEADRACE_TEST_DEVICE", "").startswith("cuda"):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import logging
import pathlib
import shutil
import subprocess

import pytest
import structlog

from headrace.cli import main as cli_main
from headrace.common import logs as common_logs
from tests.checkpoints import make_checkpoint
from tests.harness import Planes

# A command's main() run in-process configures logging for the whole test process; cached
# loggers would then keep that configuration forever, and structlog's capture_logs in a later
# test would see nothing. The tests' processes never cache them.
_configure_logging = common_logs.configure_logging


def _configure_uncached(*args, cache_loggers: bool = True, **kwargs):
    return _configure_logging(*args, cache_loggers=False, **kwargs)


common_logs.configure_logging = cli_main.configure_logging = _configure_uncached


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test():
    """A test that configures logging (a command's main() run in-process) leaves no handler
    of ours behind: it writes to the stream the test had, which pytest closes after it, and a
    server thread still finishing its work would log into a closed file ("--- Logging error
    ---"). pytest's own handlers are left alone."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and isinstance(handler.formatter, structlog.stdlib.ProcessorFormatter):
            root.removeHandler(handler)
    root.setLevel(level)

# (family, options): GQA ratios 1 and 4, head_dim 64 and 128, tied and untied embeddings,
# qkv bias (qwen2), q/k norm (qwen3), llama3 rope scaling.
VARIANTS = {
    "llama-gqa4-hd64-untied": ("llama", dict(heads=8, kv_heads=2, head_dim=64)),
    "llama3-rope-gqa1-hd128-tied": ("llama", dict(heads=2, kv_heads=2, head_dim=128, tie=True, extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))),
    "mistral-gqa4-hd64": ("mistral", dict(heads=4, kv_heads=1, head_dim=64)),
    "qwen2-bias-gqa1-hd64-tied": ("qwen2", dict(heads=2, kv_heads=2, head_dim=64, tie=True)),
    "qwen3-qknorm-gqa4-hd128": ("qwen3", dict(heads=4, kv_heads=1, head_dim=128)),
}


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            family, opts = VARIANTS[name]
            made[name] = make_checkpoint(tmp_path_factory.mktemp(name), family, **opts)
        return made[name]

    return get


@pytest.fixture(scope="module")
def llama_planes(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)
    planes = Planes(path, num_kv_blocks=512)
    yield planes
    planes.close()


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> pathlib.Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (tests that
    use it skip when openssl is not installed)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.pem", cwd=d)
    return d


@pytest.fixture
def poisoned(monkeypatch):
    """Every float tensor torch.empty hands out starts as NaN: an output element a kernel does
    not write shows up (the skinny GEMMs' split-K workspace is torch.zeros, and zero again after
    every kernel by contract)."""
    import torch

    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)
