"""Server reflection answers as grpc.reflection.v1 (what grpcurl and newer tools ask first) and as
grpc.reflection.v1alpha, on the real EngineServer (simulated model)."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from service.reflection import V1_FILE_NAME, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from tests.service.harness import running_server

EXPECTED_SERVICES = {"genserve.v1.GenerateService", "grpc.health.v1.Health", V1_SERVICE_NAME,
                     V1ALPHA_SERVICE_NAME}


def _classes(package: str):
    pool = descriptor_pool.Default()
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
                 for name in ("ServerReflectionRequest", "ServerReflectionResponse"))


async def _ask(channel, service: str, *requests) -> list:
    request_cls, response_cls = _classes(service.rsplit(".", 1)[0])
    call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                 request_serializer=request_cls.SerializeToString,
                                 response_deserializer=response_cls.FromString)
    return [r async for r in call(iter([request_cls(**kw) for kw in requests]), timeout=10)]


@pytest.mark.parametrize("service", [V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME])
async def test_reflection_lists_and_describes_the_services(service):
    async with running_server() as running:
        listed, described = await _ask(running.channel, service, {"list_services": ""},
                                       {"file_containing_symbol": "genserve.v1.GenerateService"})
    assert {s.name for s in listed.list_services_response.service} == EXPECTED_SERVICES
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert files[0].name == "genserve/v1/generate.proto"
    assert "Generate" in [m.name for m in files[0].service[0].method]


async def test_v1_describes_itself():
    async with running_server() as running:
        [reply] = await _ask(running.channel, V1_SERVICE_NAME, {"file_containing_symbol": V1_SERVICE_NAME})
    [file] = [descriptor_pb2.FileDescriptorProto.FromString(b)
              for b in reply.file_descriptor_response.file_descriptor_proto]
    assert (file.name, file.package) == (V1_FILE_NAME, "grpc.reflection.v1")
    assert file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
