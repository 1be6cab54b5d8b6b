"""Per-owner memory quotas, upload admission, and the guard every call passes first.

The in-flight bound (``--max-in-flight``) is gRPC's own ``maximum_concurrent_rpcs``: calls
beyond it, queued ones included, are answered RESOURCE_EXHAUSTED before their request is
read, and the count is released by gRPC whatever way a call ends.

``Quota`` charges each owner (one per token; "" when authentication is off) for the
resident bytes it holds: a tensor's bytes once per distinct content it references, however
many handles it holds on it (identical uploads share one copy; each owner holding it pays
for it, so an owner never depends on another keeping a copy alive), plus the capacity of its
KV caches. Tensor bytes are reserved *before* the backend allocates, so no request makes the
worker allocate past an owner's quota; KV growth is checked against the rows sent first and
against the cache's real capacity after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from coliworker.server.errors import ResourceExhausted


class Quota:
    """Bytes each owner may keep resident (tensors + KV); ``limit`` 0 means unlimited."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._used: dict[str, int] = {}
        self._refs: dict[tuple[str, int], int] = {}  # (owner, id(TensorData)) -> handles
        self._lock = threading.Lock()

    def used(self, owner: str) -> int:
        with self._lock:
            return self._used.get(owner, 0)

    def _add(self, owner: str, nbytes: int, what: str) -> None:
        used = self._used.get(owner, 0)
        if self.limit and used + nbytes > self.limit:
            who = f"owner {owner!r}" if owner else "this client"
            raise ResourceExhausted(
                f"{what}: needs {nbytes} bytes, {who} holds {used} of its {self.limit}-byte "
                f"quota (--quota); free tensors or sequences first"
            )
        self._used[owner] = used + nbytes

    def _sub(self, owner: str, nbytes: int) -> None:
        left = self._used.get(owner, 0) - nbytes
        if left:
            self._used[owner] = left
        else:
            self._used.pop(owner, None)

    # -- tensors ------------------------------------------------------------------------

    def reserve(self, owner: str, nbytes: int, what: str) -> None:
        """Hold ``nbytes`` for content about to be placed (``bind`` or ``unreserve`` next)."""
        with self._lock:
            self._add(owner, nbytes, what)

    def unreserve(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._sub(owner, nbytes)

    def bind(self, owner: str, data: Any) -> None:
        """The reserved bytes are now ``data``: the owner's first handle on it."""
        with self._lock:
            self._refs[(owner, id(data))] = 1

    def acquire(self, owner: str, data: Any, what: str) -> None:
        """A new handle of ``owner`` on resident ``data``; charged on its first handle."""
        key = (owner, id(data))
        with self._lock:
            n = self._refs.get(key, 0)
            if n == 0:
                self._add(owner, data.nbytes, what)
            self._refs[key] = n + 1

    def release(self, owner: str, data: Any) -> None:
        """One handle of ``owner`` on ``data`` went away."""
        key = (owner, id(data))
        with self._lock:
            n = self._refs.get(key, 0) - 1
            if n > 0:
                self._refs[key] = n
                return
            self._refs.pop(key, None)
            self._sub(owner, data.nbytes)

    # -- KV caches ----------------------------------------------------------------------

    def check(self, owner: str, nbytes: int, what: str) -> None:
        """Raise if ``owner`` cannot take ``nbytes`` more (charges nothing)."""
        with self._lock:
            self._add(owner, nbytes, what)
            self._sub(owner, nbytes)

    def charge(self, owner: str, nbytes: int) -> bool:
        """Account bytes already allocated; False when the owner is now over its quota."""
        with self._lock:
            used = self._used.get(owner, 0) + nbytes
            self._used[owner] = used
            return not self.limit or used <= self.limit

    def discharge(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._sub(owner, nbytes)


def check_upload(
    quota: Quota, budget: Any, backend: Any, device: int, nbytes: int, owner: str, op: str
) -> None:
    """Refuse an upload of ``nbytes`` before its receive buffer is allocated: over the
    owner's quota, over the device budget, or (with no budget set) over the device's free
    memory. A header claiming a huge tensor therefore costs the worker nothing."""
    quota.check(owner, nbytes, op)
    if budget.limit:
        if not budget.fits(device, nbytes):
            raise ResourceExhausted(
                f"{op}: tensor of {nbytes} bytes does not fit device {device}'s budget of "
                f"{budget.limit} bytes (--memory-limit)"
            )
        return
    free = next((d.free_memory_bytes for d in backend.devices() if d.id == device), None)
    if free is not None and nbytes > free:
        raise ResourceExhausted(
            f"{op}: tensor of {nbytes} bytes exceeds device {device}'s free memory ({free} bytes)"
        )


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
    """

    def __init__(self, instance_id: str = "") -> None:
        self._mark = (("coliworker-instance", instance_id),) if instance_id else None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
        mark = self._mark
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                if mark:
                    context.set_trailing_metadata(mark)
                if isinstance(request, _Malformed):
                    _refuse(context, method, request)
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended first")
                return inner(request, context)

            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.unary_stream_rpc_method_handler
            )
            return make(unary, parse, handler.response_serializer)
        inner_s = handler.stream_unary or handler.stream_stream

        def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            if mark:
                context.set_trailing_metadata(mark)
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended first")
            return inner_s(_checked(requests, context, method), context)

        make_s = (
            grpc.stream_unary_rpc_method_handler
            if handler.stream_unary
            else grpc.stream_stream_rpc_method_handler
        )
        return make_s(streaming, parse, handler.response_serializer)


__all__ = ["GuardInterceptor", "Quota", "check_upload"]
