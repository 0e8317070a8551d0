"""TLS, mutual TLS and bearer tokens on the public API, and the shared secret (and TLS) with
which a data plane accepts only its control plane. Certificates are made with openssl
(``certs``, tests/conftest.py)."""

from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from headrace.common import security
from headrace.dataplane.server import serve
from tests.checkpoints import make_checkpoint
from tests.harness import Planes, completion
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.worker.v1 import worker_pb2_grpc as wpb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)


def _generate(channel, metadata=()):
    stub = pb_grpc.InferenceStub(channel)
    return list(stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=3, ignore_eos=True),
                              metadata=metadata, timeout=30))


def test_tls_and_mutual_tls_on_the_public_api(model_dir, certs):
    c = lambda n: str(certs / n)  # noqa: E731
    tls = security.server_credentials(c("server.pem"), c("server.key"), c("ca.pem"))   # mutual
    with_cert = security.channel_credentials(c("ca.pem"), c("client.pem"), c("client.key"))
    planes = Planes(model_dir, num_kv_blocks=64, plane_options={"tls": tls}, secure_channel=with_cert)
    try:
        assert completion(planes.generate(prompt="hello", max_tokens=3, ignore_eos=True))[2] == \
            pb.FINISH_REASON_LENGTH
        for creds in (security.channel_credentials(c("ca.pem")), None):   # no client cert; plaintext
            channel = (grpc.secure_channel(planes.address, creds) if creds
                       else grpc.insecure_channel(planes.address))
            with channel, pytest.raises(grpc.RpcError) as info:
                _generate(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        planes.close()


def test_bearer_token_on_the_public_api(model_dir):
    planes = Planes(model_dir, num_kv_blocks=64, plane_options={"api_token": "s3cret"})
    try:
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            with pytest.raises(grpc.RpcError) as info:
                _generate(planes.channel, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.InferenceStub(planes.channel).GetModelInfo(pb.GetModelInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = _generate(planes.channel, (("authorization", "Bearer s3cret"),))
        assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # health stays open for orchestrators' probes
        health = health_pb2_grpc.HealthStub(planes.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        planes.close()


def test_data_plane_serves_only_its_control_plane(model_dir, certs, tmp_path):
    c = lambda n: str(certs / n)  # noqa: E731
    worker_tls = security.server_credentials(c("server.pem"), c("server.key"), c("ca.pem"))
    planes = Planes(model_dir, num_kv_blocks=64, worker_address="127.0.0.1:0",
                    worker_options={"secret": "link-secret", "credentials": worker_tls},
                    plane_options={"worker_secret": "link-secret",
                                   "worker_credentials": security.channel_credentials(
                                       c("ca.pem"), c("client.pem"), c("client.key"))})
    try:
        assert completion(planes.generate(prompt="hello", max_tokens=3, ignore_eos=True))[2] == \
            pb.FINISH_REASON_LENGTH
    finally:
        planes.close()
    # a caller with the right certificate but not the secret is refused
    server = serve(planes.worker, "127.0.0.1:0", secret="link-secret")
    try:
        port = server.worker_port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = wpb_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Describe(wpb.DescribeRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Execute(iter([wpb.StepRequest(step_id=1)]), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.Describe(wpb.DescribeRequest(), metadata=security.bearer_metadata("link-secret"),
                                 timeout=10)
            assert info.num_kv_blocks == 64
    finally:
        server.stop(0).wait()
