"""gRPC health checking and server reflection, both optional.

``grpcio-health-checking`` and ``grpcio-reflection`` come with the ``ops`` extra; where they
are missing (the bare GPU machine) ``Health`` and ``enable_reflection`` log a warning and do
nothing, so the worker still serves. ``probe`` needs neither: it speaks grpc.health.v1 with
hand-encoded bytes, so a container HEALTHCHECK works on any image that has the worker.

    python -m coliworker.server.health 127.0.0.1:50051    # exit 0 when SERVING
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import grpc

log = logging.getLogger(__name__)

WORKER_SERVICE = "coliworker.v1.Worker"
HEALTH_SERVICE = "grpc.health.v1.Health"
_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING

try:
    from grpc_health.v1 import health as _health
    from grpc_health.v1 import health_pb2 as _health_pb2
    from grpc_health.v1 import health_pb2_grpc as _health_pb2_grpc
except ImportError:  # pragma: no cover - exercised on machines without the ops extra
    _health = None

try:
    from grpc_reflection.v1alpha import reflection as _reflection
except ImportError:  # pragma: no cover
    _reflection = None


class Health:
    """The standard grpc.health.v1 service for "" (the whole server) and the Worker service.

    Starts NOT_SERVING; the server calls ``set_serving()`` once it accepts calls and
    ``set_not_serving()`` (or ``shutdown()``) when it starts draining.
    """

    SERVICES = ("", WORKER_SERVICE)

    def __init__(self) -> None:
        self.available = _health is not None
        self._servicer: Any = None
        if self.available:
            self._servicer = _health.HealthServicer(experimental_non_blocking=True)
            self._set(_health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            log.warning(
                "grpcio-health-checking is not installed: the grpc.health.v1 service is off "
                "(pip install 'coliworker[ops]')"
            )

    def attach(self, server: grpc.Server) -> None:
        """Add the health service to ``server`` (before ``server.start()``)."""
        if self._servicer is not None:
            _health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set_serving(self) -> None:
        if self._servicer is not None:
            self._set(_health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        if self._servicer is not None:
            self._set(_health_pb2.HealthCheckResponse.NOT_SERVING)

    def shutdown(self) -> None:
        """NOT_SERVING for every service, now and for any later ``set`` (graceful stop)."""
        if self._servicer is not None:
            self._servicer.enter_graceful_shutdown()

    def _set(self, status: int) -> None:
        for service in self.SERVICES:
            self._servicer.set(service, status)


def enable_reflection(server: grpc.Server) -> bool:
    """Serve grpc.reflection.v1alpha for the Worker, Health and reflection services (so
    ``grpcurl`` and ``grpcui`` work without the .proto). Returns False where unavailable."""
    if _reflection is None:
        log.warning("grpcio-reflection is not installed: server reflection is off")
        return False
    from coliworker.v1 import worker_pb2

    names = [
        worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
        _reflection.SERVICE_NAME,
    ]
    if _health is not None:
        names.append(_health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    _reflection.enable_server_reflection(names, server)
    return True


def probe(address: str, service: str = "", timeout: float = 3.0, tls: Any = None) -> int:
    """Ask grpc.health.v1 Check at ``address``: 0 when SERVING, 1 otherwise (unreachable,
    NOT_SERVING, unknown service). Prints one line saying which."""
    # HealthCheckRequest{service=1: string}; HealthCheckResponse{status=1: enum}.
    raw = service.encode()
    request = (b"\x0a" + _varint(len(raw)) + raw) if raw else b""
    try:
        if tls is None:
            channel = grpc.insecure_channel(address)
        else:
            name = getattr(tls, "server_name", None)
            options = [("grpc.ssl_target_name_override", name)] if name else []
            channel = grpc.secure_channel(address, tls.credentials(), options=options)
        with channel:
            check = channel.unary_unary(_CHECK)
            reply = check(request, timeout=timeout)
    except grpc.RpcError as err:
        print(f"health {address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = _read_status(reply)
    name = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status)
    print(f"health {address} {service or '(server)'}: {name or status}")
    return 0 if status == _SERVING else 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_status(reply: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; proto3 omits it when 0 (UNKNOWN)."""
    if len(reply) >= 2 and reply[0] == 0x08:
        return reply[1] & 0x7F
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m coliworker.server.health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return probe(args[0], args[1] if len(args) == 2 else "")


__all__ = ["HEALTH_SERVICE", "WORKER_SERVICE", "Health", "enable_reflection", "main", "probe"]

if __name__ == "__main__":
    raise SystemExit(main())
