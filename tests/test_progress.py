"""A data plane's start-up: progress while it loads (log lines, or a tqdm bar on a terminal)
for the weights, the KV cache and CUDA-graph capture, each phase's duration for the
ready line, and one-line messages for a model or device that cannot load."""

from __future__ import annotations

import io
import logging

from headrace.dataplane.progress import Phases, Progress
from headrace.dataplane.worker import Worker, WorkerOptions
from tests.checkpoints import make_checkpoint


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_worker_logs_each_phase_and_times_it(tmp_path, caplog):
    model = make_checkpoint(tmp_path / "m", "llama", heads=4, kv_heads=2, head_dim=32, layers=3)
    with caplog.at_level(logging.INFO, logger="headrace.dataplane"):
        worker = Worker(WorkerOptions(model=str(model), num_kv_blocks=32, dtype="float32"))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("loading weights: 0/") for line in lines)
    done = [line for line in lines if line.startswith("loading weights:") and " in " in line]
    assert done and "tensors in" in done[0]
    assert any(line.startswith("allocating KV cache (32 blocks") and "3 layers in" in line for line in lines)
    assert list(worker.phases.seconds) == ["weights", "KV cache"]
    assert worker.phases.summary().startswith("weights ") and ", KV cache " in worker.phases.summary()


def test_a_terminal_gets_a_bar_and_logs_in_between(caplog):
    term = _Terminal()
    with Progress("capturing CUDA graphs", 4, "graphs", stream=term) as progress:
        for _ in range(4):
            progress.update()
    assert "capturing CUDA graphs:" in term.getvalue() and "/4 [" in term.getvalue()   # a tqdm bar
    quiet = _Terminal()
    with caplog.at_level(logging.INFO, logger="headrace.dataplane"):
        with Progress("loading weights", 10, "tensors", rank=1, stream=quiet, interval=0) as progress:
            for _ in range(10):
                progress.update()
    assert quiet.getvalue() == ""   # rank 1 logs instead of drawing over rank 0's bar
    assert sum("loading weights:" in r.getMessage() for r in caplog.records) >= 10


def test_phases_add_up_in_order():
    phases = Phases()
    phases.mark("weights")
    phases.mark("KV cache")
    phases.mark("weights")
    assert list(phases.seconds) == ["weights", "KV cache"]


def test_load_failures_are_one_line_saying_what_to_do(tmp_path):
    import pytest
    import torch

    from headrace.dataplane.worker import check_device, load_failure

    check_device("cpu")
    for device, message in (("meta", "cpu or cuda"), ("nonsense", "not a device")):
        with pytest.raises(ValueError, match=message):
            check_device(device)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible.*use --device cpu"):
            Worker(WorkerOptions(model=str(tmp_path), device="cuda"))
    model = make_checkpoint(tmp_path / "m", "llama", heads=4, kv_heads=2, head_dim=32)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    opts = WorkerOptions(model=str(model), num_kv_blocks=8)
    with pytest.raises(Exception) as info:
        Worker(opts)
    line = load_failure(info.value, opts)
    assert line == f"cannot load the model in {model} on cpu: no *.safetensors files in {model}"
    assert load_failure(ValueError("--device cuda: no CUDA GPU"), opts) == "--device cuda: no CUDA GPU"
    assert "out of memory" in load_failure(torch.OutOfMemoryError("CUDA out of memory"), opts)
