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
    from grpc_health.v1 import health_pb2 as _health_pb2
    from grpc_health.v1 import health_pb2_grpc as _health_pb2_grpc
except ImportError:  # pragma: no cover - only where the dependency was left out by hand
    _health_pb2 = None


class Health:
    """The standard grpc.health.v1 service for "" (the whole server) and the Worker service.

    Starts NOT_SERVING; the server calls ``set_serving()`` once it accepts calls and
    ``set_not_serving()`` (or ``shutdown()``) when it starts draining. One registry
    (``_Watches``) holds each service's status and the open Watch streams; ``Check``, ``List``
    and ``Watch`` all answer from it. grpcio-health-checking gives the messages and the
    service stub only: its own servicer sends a status change to each watcher while holding
    the lock its close callback takes, and a send waits for gRPC's completion thread, so a
    change made while a watcher disconnected (a drain with watchers open) deadlocked the
    stopping worker.
    """

    SERVICES = ("", WORKER_SERVICE)

    def __init__(self) -> None:
        self.available = _health_pb2 is not None
        self.watches: _Watches | None = None
        if self.available:
            self.watches = _Watches(self.SERVICES)
        else:
            log.warning(
                "grpcio-health-checking is not installed: the grpc.health.v1 service is off "
                "(pip install grpcio-health-checking)"
            )

    def attach(self, server: grpc.Server) -> None:
        """Add the health service to ``server`` (before ``server.start()``)."""
        if self.watches is not None:
            _health_pb2_grpc.add_HealthServicer_to_server(_servicer(self.watches), server)

    def set_serving(self) -> None:
        if self.watches is not None:
            self.watches.set(_health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        if self.watches is not None:
            self.watches.set(_health_pb2.HealthCheckResponse.NOT_SERVING)

    def shutdown(self) -> None:
        """NOT_SERVING for every service, now and for any later ``set`` (graceful stop)."""
        if self.watches is not None:
            self.watches.set(_health_pb2.HealthCheckResponse.NOT_SERVING, final=True)

    def interceptor(self, max_watches: int = MAX_WATCHES) -> grpc.ServerInterceptor:
        """Serves ``Health/Watch`` itself, ahead of every other interceptor, to keep it
        non-blocking (a Watch wrapped by another interceptor holds a --workers thread for
        as long as it is open) and to bound open Watch streams to ``max_watches``: beyond
        that a Watch is answered RESOURCE_EXHAUSTED. Put it first in the list."""
        return _WatchInterceptor(self.watches, max_watches)


def _servicer(watches: _Watches) -> Any:
    """grpc.health.v1.Health answered from ``watches`` (Watch too, where the interceptor is
    not in front of it)."""

    class Servicer(_health_pb2_grpc.HealthServicer):
        def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
            status = watches.status(request.service)
            if status is None:
                context.set_code(grpc.StatusCode.NOT_FOUND)
                context.set_details(f"Check: no service {request.service!r} on this worker")
                return _health_pb2.HealthCheckResponse()
            return _health_pb2.HealthCheckResponse(status=status)

        def List(self, request: Any, context: grpc.ServicerContext) -> Any:
            statuses = {s: _health_pb2.HealthCheckResponse(status=v)
                        for s, v in watches.statuses().items()}  # fmt: skip
            return _health_pb2.HealthListResponse(statuses=statuses)

        def Watch(self, request: Any, context: grpc.ServicerContext, send_response_callback=None):
            if send_response_callback is None:  # pragma: no cover - a gRPC without callbacks
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch: needs a non-blocking server")
            watches.watch(request.service, send_response_callback, context)

    Servicer.Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    if not hasattr(_health_pb2, "HealthListResponse"):  # pragma: no cover - older releases
        del Servicer.List
    return Servicer()


class _Watches:
    """Each service's status and the open Watch streams. A status goes out with no lock of
    this registry held (a send waits for gRPC's completion thread, which runs the close
    callbacks that take it); one watcher's sends are serialized by its own lock and each
    sends the service's latest status, so a watcher never ends on a stale one. A watcher
    whose stream has ended meanwhile just fails its send."""

    class Watcher:
        __slots__ = ("last", "lock", "send", "service")

        def __init__(self, service: str, send: Any) -> None:
            self.service, self.send, self.last = service, send, None
            self.lock = threading.Lock()

    def __init__(self, services: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._status = {s: _health_pb2.HealthCheckResponse.NOT_SERVING for s in services}
        self._final = False
        self._watchers: set[_Watches.Watcher] = set()

    def status(self, service: str) -> int | None:
        with self._lock:
            return self._status.get(service)

    def statuses(self) -> dict[str, int]:
        with self._lock:
            return dict(self._status)

    def set(self, status: int, final: bool = False) -> None:
        with self._lock:
            if self._final:
                return
            self._final = final
            for service in self._status:
                self._status[service] = status
            watchers = list(self._watchers)
        for w in watchers:
            self._push(w)

    def watch(self, service: str, send: Any, context: grpc.ServicerContext) -> None:
        """Register ``send`` (gRPC's non-blocking send_response_callback) for ``service``:
        its status now, and every change until the stream ends."""
        w = self.Watcher(service, send)
        with self._lock:
            self._watchers.add(w)

        def closed() -> None:
            with self._lock:
                self._watchers.discard(w)

        if not context.add_callback(closed):
            closed()  # the call already ended
            return
        self._push(w)

    def _push(self, w: _Watches.Watcher) -> None:
        with w.lock:
            with self._lock:
                status = self._status.get(
                    w.service, _health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                )
            if status == w.last:
                return
            w.last = status
            try:
                w.send(_health_pb2.HealthCheckResponse(status=status))
            except Exception:  # the stream ended under the send
                log.debug("health Watch: sending a status failed", exc_info=True)

    def open(self) -> int:
        with self._lock:
            return len(self._watchers)


class _WatchInterceptor(grpc.ServerInterceptor):
    def __init__(self, watches: _Watches | None, max_watches: int) -> None:
        self._watches, self.max_watches = watches, max_watches
        self.open = 0
        self._lock = threading.Lock()
        self._handler = None
        if watches is not None:
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
        assert self._watches is not None and send_response_callback is not None
        self._watches.watch(request.service, send_response_callback, context)

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
    if _health_pb2 is not None:
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
