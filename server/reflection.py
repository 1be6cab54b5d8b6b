"""gRPC server reflection, both versions: grpc.reflection.v1 and grpc.reflection.v1alpha.

``grpcio-reflection`` ships only v1alpha in Python, while current clients (``grpcurl``,
``grpcui``, Postman) ask for v1 first. The two protocols are the same messages under two
package names, field for field, so one servicer answers both: the v1 service is the
v1alpha servicer registered under the v1 name (the bytes decode the same), and its
descriptor, the v1alpha file renamed, goes into the descriptor pool so that v1 can be
described like every other listed service.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"

try:
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection as _reflection
    from grpc_reflection.v1alpha import reflection_pb2 as _pb2
except ImportError:  # pragma: no cover - only where the dependency was left out by hand
    _reflection = None


def _add_v1_descriptor() -> None:
    """Put grpc/reflection/v1/reflection.proto into the default pool (once)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    _pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = "grpc.reflection.v1"
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in file.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in file.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.Add(file)


def enable_reflection(server: grpc.Server, services: list[str]) -> bool:
    """Serve reflection (v1 and v1alpha) for ``services`` plus the reflection services
    themselves. Returns False, with a warning, where grpcio-reflection is missing."""
    if _reflection is None:
        log.warning("grpcio-reflection is not installed: server reflection is off")
        return False
    _add_v1_descriptor()
    servicer = _reflection.ReflectionServicer([*services, V1, V1ALPHA])
    for name in (V1ALPHA, V1):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=_pb2.ServerReflectionRequest.FromString,
            response_serializer=_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
    return True


__all__ = ["V1", "V1ALPHA", "enable_reflection"]
