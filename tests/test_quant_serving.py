"""Quantization through the planes: a worker with FP8 weights and an FP8 KV cache serves, says
so in Describe / GetModelInfo, holds twice the tokens in the same KV memory, and a bad scheme
fails at load with an error naming it."""

from __future__ import annotations

import pytest

from headrace.dataplane.quantization import QuantizationError
from headrace.dataplane.server import serve
from headrace.dataplane.worker import Worker, WorkerOptions
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes, completion
from tests.test_quant_accuracy import TINY


def test_fp8_kv_cache_holds_twice_the_tokens():
    opts = dict(model=str(TINY), dtype="bfloat16", cpu_kv_cache_gib=0.01)
    auto = Worker(WorkerOptions(**opts))
    fp8 = Worker(WorkerOptions(**opts, kv_cache_dtype="fp8"))
    assert auto.block_bytes == 2 * fp8.block_bytes
    assert fp8.runner.num_blocks // 2 == auto.runner.num_blocks   # same bytes, floor division
    assert fp8.runner.kv_caches[0].dtype.itemsize == 1
    vllm_name = Worker(WorkerOptions(**opts, kv_cache_dtype="fp8_e4m3"))   # vLLM's spelling
    assert vllm_name.runner.kv_caches[0].dtype == fp8.runner.kv_caches[0].dtype
    assert vllm_name.block_bytes == fp8.block_bytes


def test_planes_serve_fp8_weights_and_kv_and_report_them(tmp_path):
    worker = Worker(WorkerOptions(model=str(TINY), quantization="fp8", kv_cache_dtype="fp8",
                                  num_kv_blocks=64, dtype="float32"))
    address = f"unix:{tmp_path}/dp.sock"
    server = serve(worker, address)
    planes = Planes(TINY, workers=[address])
    try:
        info = planes.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.kv_cache_dtype == "float8_e4m3fn"
        assert info.quantization.startswith("fp8 (fp8 w8a8, dynamic activations)")
        ids, text, _ = completion(planes.generate(
            prompt="It is a truth universally acknowledged", max_tokens=12,
            sampling=pb.SamplingParams(temperature=0.0)))
        assert len(ids) == 12 and text.strip()
    finally:
        planes.close()
        server.stop(0).wait()


def test_unsupported_scheme_fails_at_load_naming_it():
    with pytest.raises(QuantizationError, match="--quantization awq needs a checkpoint quantized"):
        Worker(WorkerOptions(model=str(TINY), quantization="awq"))
    with pytest.raises(QuantizationError, match="'int4' is not supported"):
        Worker(WorkerOptions(model=str(TINY), quantization="int4"))
    with pytest.raises(ValueError, match="kv-cache-dtype 'int4'"):
        Worker(WorkerOptions(model=str(TINY), kv_cache_dtype="int4"))
    with pytest.raises(ValueError, match="--block-size 24: an FP8 KV cache needs a power-of-two"):
        Worker(WorkerOptions(model=str(TINY), kv_cache_dtype="fp8", block_size=24))


def test_a_quant_backend_that_cannot_run_fails_at_start_naming_it(monkeypatch):
    """--quant-backend gemlite / fbgemm / torch need a CUDA device and their package: the
    worker stops before reading weights, with the flag, the reason and the install hint."""
    with pytest.raises(ValueError, match="--quant-backend gemlite: its kernels need a CUDA"):
        Worker(WorkerOptions(model=str(TINY), quantization="fp8", quant_backend="gemlite"))
    from headrace.kernels import quant_dispatch, quant_libs
    monkeypatch.setattr(quant_libs, "why_not", lambda library: (
        f"the {library} package is not installed or does not import "
        f"(pip install 'headrace[{library}]')"))
    read = []
    monkeypatch.setattr("headrace.dataplane.worker.load_model", lambda *a, **kw: read.append(a))
    with pytest.raises(ValueError, match=r"--quant-backend fbgemm: the fbgemm package .*headrace\[fbgemm\]"):
        quant_dispatch.resolve_backend("fbgemm", "cuda", quant_libs.why_not)
    with pytest.raises(ValueError, match=r"headrace\[gemlite\]"):
        monkeypatch.setattr("headrace.dataplane.worker.check_device", lambda device: None)
        Worker(WorkerOptions(model=str(TINY), quantization="fp8", quant_backend="gemlite",
                             device="cuda"))
    assert not read                      # no weight was read
    # without quantized layers the flag has nothing to run: no error
    monkeypatch.setattr("headrace.dataplane.worker.load_model", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("loading")))
    with pytest.raises(RuntimeError, match="loading"):
        Worker(WorkerOptions(model=str(TINY), quant_backend="gemlite", device="cuda"))
