"""The guard every call passes first: the in-flight bound, the worker's mark, request
bytes that do not parse, calls that ended while they queued, stalled upload streams.

The in-flight bound (``--max-in-flight``) counts the calls of the Worker service that
passed authentication (``AuthInterceptor`` runs first and answers refused calls itself),
from the moment gRPC hands them to the interceptors (before they queue for a thread) until
they end. Health checks and unauthenticated calls never count, so neither can fill it for
the owners that hold tokens; gRPC's own ``maximum_concurrent_rpcs`` stays as a backstop
above it (``backstop``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from coliworker.server.auth import OPEN_SERVICES
from coliworker.server.errors import InvalidArgument
from coliworker.server.idle import IdleWatchdog, Watch

#: Calls gRPC itself admits beyond --max-in-flight (health checks, refusals): a backstop.
OPEN_CALLS = 256


class _Malformed:
    """What the request deserializer returns for bytes that are not the request message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything a parser throws on garbage
            return _Malformed(exc)

    return parse


def _refuse(context: grpc.ServicerContext, method: str, bad: _Malformed) -> None:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: request bytes are not a valid message ({type(bad.error).__name__})",
    )


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
    for r in requests:
        if isinstance(r, _Malformed):
            _refuse(context, method, r)
        yield r


class _Release:
    """Gives one in-flight slot back, once, however many ways the call reports its end."""

    __slots__ = ("_guard", "_done")

    def __init__(self, guard: GuardInterceptor) -> None:
        self._guard, self._done = guard, False

    def __call__(self) -> None:
        with self._guard._lock:
            if self._done:
                return
            self._done = True
            self._guard.in_flight -= 1


def _releasing(responses: Iterator[Any], release: _Release) -> Iterator[Any]:
    try:
        yield from responses
    finally:
        release()


def _touching(requests: Iterator[Any], watch: Watch, method: str) -> Iterator[Any]:
    try:
        for r in requests:
            watch.touch()
            yield r
    except grpc.RpcError:  # cancelled: by the client, or by the watchdog (nothing arrived)
        raise InvalidArgument(
            f"{method}: the stream ended before its last message (cancelled, or nothing sent "
            f"for --idle-timeout)"
        ) from None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers RESOURCE_EXHAUSTED without reading."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


def backstop(max_in_flight: int) -> int:
    """gRPC's ``maximum_concurrent_rpcs``: above the guard's bound, for what it never counts."""
    return max_in_flight + OPEN_CALLS


class GuardInterceptor(grpc.ServerInterceptor):
    """Marks every answer as the worker's, then runs two checks before a handler runs.

    The mark is the instance id in the *trailing* metadata (``coliworker-instance``): only a
    call the worker completed carries it, so a client tells a status the worker sent (an
    UNAVAILABLE compute fault: use the CPU path) from one its transport made up when the
    worker died mid-call (retry once it is back).

    - bytes that do not parse as the request message are answered INVALID_ARGUMENT (gRPC
      itself would answer INTERNAL, which reads as a worker bug);
    - calls whose client cancelled, or whose deadline passed while they queued for a thread,
      are skipped: the worker does no work nobody will read.

    Before that, a call beyond ``max_in_flight`` (0: no bound) is answered
    RESOURCE_EXHAUSTED at once (see the module docstring), and the request streams of
    ``idle_methods`` (Upload, Update) are cancelled once they send nothing for the
    watchdog's timeout (``--idle-timeout``), so a stalled upload gives its thread back.
    """

    def __init__(
        self,
        instance_id: str = "",
        max_in_flight: int = 0,
        idle: IdleWatchdog | None = None,
        idle_methods: tuple[str, ...] = (),
    ) -> None:
        self._mark = (("coliworker-instance", instance_id),) if instance_id else None
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._lock = threading.Lock()
        self._idle = idle
        self._idle_methods = frozenset(idle_methods)

    def _admit(self, method: str) -> _Release | str:
        """A slot for one call, or the refusal message."""
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                return (
                    f"{method}: {self.in_flight} calls in flight, limit {self.max_in_flight} "
                    f"(--max-in-flight); try again later"
                )
            self.in_flight += 1
        return _Release(self)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        full: str = details.method  # type: ignore[attr-defined]
        method = full.rsplit("/", 1)[-1]
        release: _Release | None = None
        if self.max_in_flight and not full.startswith(OPEN_SERVICES):
            admitted = self._admit(method)
            if isinstance(admitted, str):
                return _refusal(handler, admitted)
            release = admitted
        mark = self._mark
        idle = self._idle if handler.stream_unary and method in self._idle_methods else None
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                streams = False
                try:
                    if release is not None:
                        context.add_callback(release)
                    if mark:
                        context.set_trailing_metadata(mark)
                    if isinstance(request, _Malformed):
                        _refuse(context, method, request)
                    if not context.is_active():
                        context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended first")
                    out = inner(request, context)
                    if release is not None and handler.unary_stream:
                        streams = True
                        return _releasing(out, release)
                    return out
                finally:
                    if release is not None and not streams:
                        release()

            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.unary_stream_rpc_method_handler
            )
            return make(unary, parse, handler.response_serializer)
        inner_s = handler.stream_unary or handler.stream_stream

        def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            streams = False
            watch = None
            try:
                if release is not None:
                    context.add_callback(release)
                if mark:
                    context.set_trailing_metadata(mark)
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended first")
                checked = _checked(requests, context, method)
                if idle is not None:
                    watch = idle.watch(context.cancel, f"{method} stream")
                    checked = _touching(checked, watch, method)
                out = inner_s(checked, context)
                if release is not None and handler.stream_stream:
                    streams = True
                    return _releasing(out, release)
                return out
            finally:
                if watch is not None:
                    watch.close()
                if release is not None and not streams:
                    release()

        make_s = (
            grpc.stream_unary_rpc_method_handler
            if handler.stream_unary
            else grpc.stream_stream_rpc_method_handler
        )
        return make_s(streaming, parse, handler.response_serializer)


__all__ = ["OPEN_CALLS", "GuardInterceptor", "backstop"]
