"""gRPC server reflection under both of its names: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

Tools such as grpcurl, Postman and grpcui ask for `grpc.reflection.v1.ServerReflection` first.
grpcio-reflection (1.85, the pinned version) ships only the v1alpha service. The two protocols are
the same file under two package names (field numbers, types and semantics are equal; v1 only
renamed the package), so one servicer answers both: v1alpha's, registered as itself and once
more under the v1 name with v1alpha's message classes, which read and write v1's bytes as they
are. The v1 file's descriptor, derived from v1alpha's by renaming the package, is added to the
protobuf pool so that reflection can describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME         # "grpc.reflection.v1alpha.ServerReflection"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"    # as grpc's repository names it
METHOD = "ServerReflectionInfo"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto's descriptor: v1alpha's with the package renamed (the
    protocol is otherwise identical) and the option names of grpc's v1 file."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE_NAME, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = f".{V1_PACKAGE}." + field.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}." + method.input_type[len(old):]
            method.output_type = f".{V1_PACKAGE}." + method.output_type[len(old):]
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    return proto


def _ensure_v1_in_pool(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 file to `pool` unless it is there (adding it twice would be refused)."""
    try:
        pool.FindFileByName(V1_FILE_NAME)
    except KeyError:
        pool.Add(v1_file_descriptor())


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection on `server` as `grpc.reflection.v1` and `grpc.reflection.v1alpha`,
    listing `service_names` and both reflection services. Uses the default protobuf pool (where
    the generated `*_pb2` modules register their files).

    Raises:
        TypeError: the pool holds a different file under the v1 name (not expected).
    """
    pool = descriptor_pool.Default()
    _ensure_v1_in_pool(pool)
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    reflection.enable_server_reflection(names, server, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {METHOD: handler}),))
