"""The worker's grpc.health.v1 service, and server reflection for its services.

``grpcio-health-checking`` and ``grpcio-reflection`` are dependencies of the package; where
one was left out by hand (a source tree on PYTHONPATH) ``Health`` and ``enable_reflection``
log a warning and do nothing, so the worker still serves. The client-side probe that
container HEALTHCHECKs run is ``coliworker.tools.health`` (``coliworker health``).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from coliworker.server import reflection
from coliworker.tools.health import main, probe  # moved to the tools; kept importable here

log = logging.getLogger(__name__)

WORKER_SERVICE = "coliworker.v1.Worker"
HEALTH_SERVICE = "grpc.health.v1.Health"

try:
    from grpc_health.v1 import health as _health
    from grpc_health.v1 import health_pb2 as _health_pb2
    from grpc_health.v1 import health_pb2_grpc as _health_pb2_grpc
except ImportError:  # pragma: no cover - only where the dependency was left out by hand
    _health = None


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
                "(pip install grpcio-health-checking)"
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
    """Serve reflection (grpc.reflection.v1 and v1alpha) for the Worker, Health and
    reflection services, so ``grpcurl`` and ``grpcui`` work without the .proto. Returns
    False where grpcio-reflection is missing."""
    from coliworker.v1 import worker_pb2

    names = [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name]
    if _health is not None:
        names.append(_health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    return reflection.enable_reflection(server, names)


__all__ = ["HEALTH_SERVICE", "WORKER_SERVICE", "Health", "enable_reflection", "main", "probe"]

if __name__ == "__main__":
    raise SystemExit(main())
