"""The data plane's operations surface: health NOT_SERVING until the model is loaded, Reload
(another checkpoint, superseding the open step stream; a failed load puts the old model back)
and its step metrics."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.dataplane.server import serve
from headrace.dataplane.worker import Worker, WorkerOptions
from tests.checkpoints import make_checkpoint
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (make_checkpoint(tmp_path_factory.mktemp("dp-a"), "llama", heads=4, kv_heads=2, head_dim=32),
            make_checkpoint(tmp_path_factory.mktemp("dp-b"), "qwen3", heads=4, kv_heads=2, head_dim=32))


def _prefill(step_id=1):
    step = wpb.StepRequest(step_id=step_id)
    step.new_seqs.add(seq_id=1, prompt_token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3,
                      sampling=wpb.Sampling(top_p=1, repetition_penalty=1))
    return step


def test_health_loading_reload_and_metrics(models, tmp_path):
    a, b = models
    address = f"unix:{tmp_path}/w.sock"
    server = serve(None, address)
    channel = grpc.insecure_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        stub = wpb_grpc.WorkerStub(channel)
        check = lambda: health.Check(health_pb2.HealthCheckRequest()).status  # noqa: E731
        # listening, but not serving until the weights are loaded
        assert check() == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Describe(wpb.DescribeRequest())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        service = server.worker_service
        service.load(lambda: Worker(WorkerOptions(model=str(a), num_kv_blocks=16)))
        assert check() == SERVING
        assert stub.Describe(wpb.DescribeRequest()).architecture == "LlamaForCausalLM"

        # a step, then a reload to another checkpoint; a new stream runs on the new model
        requests = iter([_prefill(1)])
        results = list(stub.Execute(requests))
        assert [list(r.seq_ids) for r in results] == [[1]]
        registry = service.metrics.registry
        assert registry.get_sample_value("headrace:dataplane_steps_total") == 1
        assert registry.get_sample_value("headrace:dataplane_sampled_tokens_total") == 1

        info_b = stub.Reload(wpb.ReloadRequest(model=str(b)))
        assert info_b.architecture == "Qwen3ForCausalLM" and info_b.num_kv_blocks == 16
        assert check() == SERVING
        assert registry.get_sample_value("headrace:dataplane_model_reloads_total", {"outcome": "ok"}) == 1
        assert list(stub.Execute(iter([_prefill(1)])))[0].seq_ids == [1]

        # a checkpoint that cannot be loaded: FAILED_PRECONDITION and the old model is back
        with pytest.raises(grpc.RpcError) as info:
            stub.Reload(wpb.ReloadRequest(model=str(tmp_path / "nothing-here")))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert check() == SERVING
        assert stub.Describe(wpb.DescribeRequest()).architecture == "Qwen3ForCausalLM"
        assert registry.get_sample_value("headrace:dataplane_model_reloads_total",
                                         {"outcome": "failed"}) == 1
        # an empty model reloads the current one
        assert stub.Reload(wpb.ReloadRequest()).architecture == "Qwen3ForCausalLM"
    finally:
        channel.close()
        server.stop(0).wait()
