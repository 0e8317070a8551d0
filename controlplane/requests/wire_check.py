"""Public requests whose bytes the server would otherwise misread or fail on: bytes that do not
parse as the method's message (gRPC itself would answer UNKNOWN or INTERNAL), and integers
too wide for their 32-bit field (protobuf keeps their low 32 bits: a token id of 2**40 would
silently become 0). Both are answered INVALID_ARGUMENT with a message naming the problem.

``WireCheckInterceptor`` gives every unary-request method of the public services
(``headrace.v1.*``) a deserializer that never raises: it returns the parsed message, or a
``Malformed`` stand-in saying why not. Unary-unary methods are wrapped to refuse a
``Malformed`` request; a server-streaming method (``Inference.Generate``, whose stream is not
wrapped: no cost per streamed message) refuses it itself (``refusal``).

The width check parses the bytes a second time as a "wide" copy of the message, built here
from its descriptor, whose 32-bit integer fields are 64-bit: values that fit are written back
as the same bytes by both, so the two serialisations are compared (in C, a few microseconds
for a usual request), and only a request that differs is walked to name the field and value
(message types without 32-bit fields anywhere are not walked)."""

from __future__ import annotations

import functools

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import DecodeError

CHECKED_PREFIX = "/headrace.v1."
_WIDEN = {F.TYPE_INT32: F.TYPE_INT64, F.TYPE_SINT32: F.TYPE_SINT64, F.TYPE_UINT32: F.TYPE_UINT64}
_RANGE = {F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
          F.TYPE_UINT32: (0, (1 << 32) - 1)}
_PACKAGE = "headrace_wire_check"
_pool = descriptor_pool.DescriptorPool()


class Malformed:
    """What a request's bytes were, when they were not a valid message: ``message`` says why."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def refusal(request) -> str | None:
    """Why ``request`` (as the checked deserializer returned it) is refused, or None."""
    return request.message if isinstance(request, Malformed) else None


def _wide_name(desc) -> str:
    return "W_" + desc.full_name.replace(".", "_")


def _reachable(desc, seen: dict) -> dict:
    if desc.full_name not in seen:
        seen[desc.full_name] = desc
        for field in desc.fields:
            if field.message_type is not None:
                _reachable(field.message_type, seen)
    return seen


@functools.cache
def _narrow_fields(desc) -> bool:
    """Whether ``desc`` or a message type it holds has a 32-bit varint field."""
    return any(f.type in _RANGE or (f.message_type is not None and f.message_type is not desc
                                    and _narrow_fields(f.message_type)) for f in desc.fields)


@functools.cache
def _wide_class(desc):
    """A message class reading the same bytes as ``desc`` with its 32-bit integers 64-bit."""
    file = descriptor_pb2.FileDescriptorProto(name=f"{_PACKAGE}/{desc.full_name}.proto",
                                              package=_PACKAGE, syntax="proto3")
    for name, d in _reachable(desc, {}).items():
        proto = file.message_type.add()
        d.CopyToProto(proto)
        proto.name = _wide_name(d)
        del proto.nested_type[:]   # (referenced nested types are copied beside it)
        del proto.enum_type[:]
        proto.options.map_entry = False
        for field, original in zip(proto.field, d.fields):
            if original.type in _WIDEN:
                field.type = _WIDEN[original.type]
            elif original.type == F.TYPE_ENUM:
                field.type, field.type_name = F.TYPE_INT64, ""
            elif original.message_type is not None:
                field.type_name = f".{_PACKAGE}.{_wide_name(original.message_type)}"
    _pool.Add(file)
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{_PACKAGE}.{_wide_name(desc)}"))


def _out_of_range(desc, wide, path: str) -> str | None:
    """The first 32-bit field of ``wide`` (read as ``desc``) whose value does not fit, if any."""
    for field in desc.fields:
        name = path + field.name
        value = getattr(wide, field.name)
        repeated = field.is_repeated
        if field.type in _RANGE:
            lo, hi = _RANGE[field.type]
            values = value if repeated else (value,)
            if values and (min(values) < lo or max(values) > hi):
                bad = next(v for v in values if not lo <= v <= hi)
                kind = "uint32" if field.type == F.TYPE_UINT32 else "int32"
                return f"{name}: {bad} is out of range (a {kind} field)"
        elif field.message_type is not None and _narrow_fields(field.message_type):
            for sub in (value if repeated else ([value] if wide.HasField(field.name) else [])):
                problem = _out_of_range(field.message_type, sub, name + ".")
                if problem:
                    return problem
    return None


@functools.cache
def checked_deserializer(cls):
    """``cls.FromString`` that returns ``Malformed`` instead of raising, and for bytes whose
    32-bit integers were sent wider than their field."""
    desc = cls.DESCRIPTOR
    wide = _wide_class(desc) if _narrow_fields(desc) else None

    def deserialize(data: bytes):
        try:
            request = cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError):
            return Malformed(f"the request is not a valid {desc.full_name} message "
                             "(malformed protobuf bytes)")
        if wide is not None:   # (in range, both read the same values and write the same bytes)
            as_wide = wide.FromString(data)
            if as_wide.SerializeToString() != request.SerializeToString():
                return Malformed(_out_of_range(desc, as_wide, "") or
                                 f"the request is not a valid {desc.full_name} message")
        return request

    return deserialize


class WireCheckInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or not details.method.startswith(CHECKED_PREFIX):
            return handler
        cls = getattr(handler.request_deserializer, "__self__", None)
        if cls is None or not hasattr(cls, "DESCRIPTOR"):
            return handler
        handler = handler._replace(request_deserializer=checked_deserializer(cls))
        if handler.unary_unary is None:
            return handler   # a streaming response: the method checks ``refusal`` itself
        behavior = handler.unary_unary

        async def checked(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behavior(request, context)

        return handler._replace(unary_unary=checked)
