"""grpc.health.v1 and reflection on a real server; the container probe against it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from coliworker.server import health as health_mod
from coliworker.server import reflection as reflection_mod
from coliworker.server.health import Health, enable_reflection
from coliworker.tools import health as probe_mod
from coliworker.tools.health import probe


@pytest.fixture
def served():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = Health()
    health.attach(server)
    assert enable_reflection(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield health, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def check(address: str, service: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_follows_set_serving(served) -> None:
    from grpc_health.v1 import health_pb2

    health, address = served
    for service in ("", "coliworker.v1.Worker"):
        assert check(address, service) == health_pb2.HealthCheckResponse.NOT_SERVING
    health.set_serving()
    for service in ("", "coliworker.v1.Worker"):
        assert check(address, service) == health_pb2.HealthCheckResponse.SERVING
    health.set_not_serving()
    assert check(address, "coliworker.v1.Worker") == health_pb2.HealthCheckResponse.NOT_SERVING


def test_probe_exit_codes(served, capsys) -> None:
    health, address = served
    assert probe(address) == 1
    health.set_serving()
    assert probe(address) == 0
    assert probe(address, "coliworker.v1.Worker") == 0
    assert "SERVING" in capsys.readouterr().out
    assert probe(address, "no.such.Service") == 1  # NOT_FOUND from the health service
    health.shutdown()
    assert probe(address) == 1
    assert probe_mod.main([address]) == 1
    assert probe_mod.main([]) == 2
    assert health_mod.probe is probe  # the old import path still works


def test_probe_unreachable(capsys) -> None:
    with socket_port() as port:
        pass  # bound and released: nothing listens there now
    assert probe(f"127.0.0.1:{port}", timeout=1.0) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


SERVICES = {
    "coliworker.v1.Worker",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def _reflect(address: str, method: str, request):
    """One reflection request over ``method`` (v1 or v1alpha: the same messages)."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (reply,) = list(call(iter([request]), timeout=5))
    return reply


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_services(served, version) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    _, address = served
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    reply = _reflect(address, method, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert names == SERVICES
    for service in sorted(SERVICES):  # every listed service can be described, v1 included
        reply = _reflect(
            address, method, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
        )
        assert reply.WhichOneof("message_response") == "file_descriptor_response", service
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto
        ]
        package, _, name = service.rpartition(".")
        assert any(f.package == package and name in [s.name for s in f.service] for f in files), (
            service
        )


def test_without_the_packages_everything_is_a_no_op(monkeypatch, caplog) -> None:
    monkeypatch.setattr(health_mod, "_health_pb2", None)
    monkeypatch.setattr(reflection_mod, "_reflection", None)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    h = Health()
    h.attach(server)
    h.set_serving()
    h.set_not_serving()
    h.shutdown()
    assert not h.available
    assert enable_reflection(server) is False
    assert "grpcio-health-checking is not installed" in caplog.text


def socket_port():
    import contextlib
    import socket

    @contextlib.contextmanager
    def bound():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            yield s.getsockname()[1]

    return bound()
