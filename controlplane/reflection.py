"""gRPC server reflection under ``grpc.reflection.v1`` as well as ``grpc.reflection.v1alpha``
(grpcurl and current tools ask for v1 first). grpcio-reflection ships only v1alpha; the v1
protocol is the same messages under another package, so v1 is served by the v1alpha servicer
(identical wire format), and the v1 file descriptor is added to the default pool so that
reflection can describe itself under both names."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor() -> None:
    """grpc/reflection/v1/reflection.proto, made from v1alpha's by renaming its package."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_server_reflection(service_names, server) -> None:
    """Reflection v1 and v1alpha on ``server`` (sync or asyncio), listing ``service_names``
    and both reflection services."""
    _add_v1_descriptor()
    names = tuple(service_names) + (V1ALPHA, V1)
    servicer = (reflection.aio.ReflectionServicer(names) if isinstance(server, grpc.aio.Server)
                else reflection.ReflectionServicer(names))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": v1}),))
