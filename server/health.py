"""The worker's grpc.health.v1 service, and server reflection for its services.

``grpcio-health-checking`` and ``grpcio-reflection`` are dependencies of the package; where
one was left out by hand (a source tree on PYTHONPATH) ``Health`` and ``enable_reflection``
log a warning and do nothing, so the worker still serves. The client-side probe that
container HEALTHCHECKs run is ``coliworker.tools.health`` (``coliworker health``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from coliworker.server import reflection
from coliworker.tools.health import main, probe  # moved to the tools; kept importable here

log = logging.getLogger(__name__)

WORKER_SERVICE = "coliworker.v1.Worker"
HEALTH_SERVICE = "grpc.health.v1.Health"
#: Health/Watch streams open at once (each costs no thread, only its registration).
MAX_WATCHES = 64
_WATCH = f"/{HEALTH_SERVICE}/Watch"

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

    def interceptor(self, max_watches: int = MAX_WATCHES) -> grpc.ServerInterceptor:
        """Serves ``Health/Watch`` itself, ahead of every other interceptor, to keep it
        non-blocking (a Watch wrapped by another interceptor holds a --workers thread for
        as long as it is open) and to bound open Watch streams to ``max_watches``: beyond
        that a Watch is answered RESOURCE_EXHAUSTED. Put it first in the list."""
        return _WatchInterceptor(self._servicer, max_watches)


class _WatchInterceptor(grpc.ServerInterceptor):
    def __init__(self, servicer: Any, max_watches: int) -> None:
        self._servicer, self.max_watches = servicer, max_watches
        self.open = 0
        self._lock = threading.Lock()
        self._handler = None
        if servicer is not None:
            self._handler = grpc.unary_stream_rpc_method_handler(
                self._watch,
                request_deserializer=_health_pb2.HealthCheckRequest.FromString,
                response_serializer=_health_pb2.HealthCheckResponse.SerializeToString,
            )

    def _watch(self, request: Any, context: grpc.ServicerContext, send_response_callback=None):
        with self._lock:
            if self.open >= self.max_watches:
                refused = True
            else:
                refused = False
                self.open += 1
        if refused:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Watch: {self.max_watches} health Watch streams open, the limit; use Check",
            )
        done = [False]

        def release() -> None:
            with self._lock:
                if not done[0]:
                    done[0] = True
                    self.open -= 1

        if not context.add_callback(release):
            release()  # the call already ended
        return self._servicer.Watch(request, context, send_response_callback)

    _watch.experimental_non_blocking = True  # type: ignore[attr-defined]

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if self._handler is not None and details.method == _WATCH:  # type: ignore[attr-defined]
            return self._handler
        return continuation(details)


def enable_reflection(server: grpc.Server) -> bool:
    """Serve reflection (grpc.reflection.v1 and v1alpha) for the Worker, Health and
    reflection services, so ``grpcurl`` and ``grpcui`` work without the .proto. Returns
    False where grpcio-reflection is missing."""
    from coliworker.v1 import worker_pb2

    names = [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name]
    if _health is not None:
        names.append(_health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    return reflection.enable_reflection(server, names)


__all__ = [
    "HEALTH_SERVICE",
    "MAX_WATCHES",
    "WORKER_SERVICE",
    "Health",
    "enable_reflection",
    "main",
    "probe",
]

if __name__ == "__main__":
    raise SystemExit(main())
