"""Server reflection answers under grpc.reflection.v1 (what grpcurl asks first) as well as
v1alpha: a v1 client, built from the v1 descriptors, lists the services and fetches files."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from headrace.controlplane.reflection import V1


def _v1_call(channel, request: dict):
    pool = descriptor_pool.Default()
    req_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    resp_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    info = channel.stream_stream(f"/{V1}/ServerReflectionInfo", request_serializer=req_cls.SerializeToString,
                                 response_deserializer=resp_cls.FromString)
    return list(info(iter([req_cls(**request)]), timeout=10))[0]


def test_reflection_v1_lists_services_and_describes_them(llama_planes):
    answer = _v1_call(llama_planes.channel, {"list_services": ""})
    names = {s.name for s in answer.list_services_response.service}
    assert {"headrace.v1.Inference", "headrace.v1.Admin", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection", V1} <= names
    for symbol, package in (("headrace.v1.Inference", "headrace.v1"), (V1, "grpc.reflection.v1")):
        answer = _v1_call(llama_planes.channel, {"file_containing_symbol": symbol})
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in answer.file_descriptor_response.file_descriptor_proto]
        assert files and files[0].package == package


def test_reflection_v1alpha_still_answers(llama_planes):
    refl = reflection_pb2_grpc.ServerReflectionStub(llama_planes.channel)
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert V1 in {s.name for s in answers[0].list_services_response.service}
