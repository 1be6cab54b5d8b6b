"""grpc.health.v1 and reflection on a real server; the container probe against it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from coliworker.server import health as health_mod
from coliworker.server.health import Health, enable_reflection, probe

pytest.importorskip("grpc_health.v1.health")
pytest.importorskip("grpc_reflection.v1alpha.reflection")


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
    assert health_mod.main([address]) == 1
    assert health_mod.main([]) == 2


def test_probe_unreachable(capsys) -> None:
    with socket_port() as port:
        pass  # bound and released: nothing listens there now
    assert probe(f"127.0.0.1:{port}", timeout=1.0) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_reflection_lists_services(served) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, address = served
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert names == {
        "coliworker.v1.Worker",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_without_the_packages_everything_is_a_no_op(monkeypatch, caplog) -> None:
    monkeypatch.setattr(health_mod, "_health", None)
    monkeypatch.setattr(health_mod, "_reflection", None)
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
