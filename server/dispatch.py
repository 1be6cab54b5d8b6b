"""One dispatch for every transport: a decoded call in, a response or a status out.

Unary gRPC (``servicer.py``), the Session stream (``session.py``), the shared-memory
doorbell (``doorbell.py``) and the socket data plane (``dataplane.py``) each decode a
request into a ``coliworker.wire.calls.Call``, its request message and an ``ArrayIO``
(where its outside arrays are), know the caller's owner, and call ``Dispatch.run``. It runs
the servicer's handler of that call and turns whatever was raised into a status in
``status_of``: the one place errors become statuses. A ``WorkerError`` subclass maps to its
code with its message; anything else is logged with a tag and answered INTERNAL with a
generic message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from coliworker.server.errors import WorkerError
from coliworker.wire.calls import Call
from coliworker.wire.codec import INLINE, ArrayIO, CodecError
from coliworker.wire.frames import Closed
from coliworker.wire.shm import ShmError

log = logging.getLogger(__name__)

OK = grpc.StatusCode.OK
#: gRPC status code value -> StatusCode
STATUS_OF = {c.value[0]: c for c in grpc.StatusCode}
_SHM_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.FAILED_PRECONDITION,
    "permission": grpc.StatusCode.PERMISSION_DENIED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_of(exc: BaseException, op: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised ``exc`` answers with (the only such mapping)."""
    if isinstance(exc, WorkerError) and type(exc) is not WorkerError:
        return exc.code, exc.message
    if isinstance(exc, CodecError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ShmError):
        return _SHM_STATUS.get(exc.kind, grpc.StatusCode.CANCELLED), exc.message
    if isinstance(exc, Closed):  # the client went away while its call read its data
        return grpc.StatusCode.CANCELLED, f"{op}: the connection closed during the call"
    tag = uuid.uuid4().hex[:12]
    log.error("internal error in %s (request %s)", op, tag, exc_info=exc)
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error (request {tag}); the worker log has the details",
    )


@dataclass(slots=True)
class Outcome:
    """What a call answered: ``response`` when ``code`` is OK, else ``message``."""

    response: Any
    code: grpc.StatusCode = OK
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is OK


#: A handler: (request, owner, io) -> response; upload handlers also take the data pieces.
Handler = Callable[..., Any]


class Dispatch:
    """The handlers of one servicer by call, and the one way to run them."""

    def __init__(self, servicer: Any, hooks: Any) -> None:
        self.servicer, self.hooks = servicer, hooks
        self.last = 0.0  # time.perf_counter() of the latest call started (server/upkeep.py)

    def handler(self, call: Call) -> Handler | None:
        """The servicer's handler of ``call`` (looked up per call: tests may wrap one)."""
        if call.name == "Session":
            return None
        return getattr(self.servicer, call.kind, None)

    def run(
        self,
        call: Call,
        request: Any,
        owner: str,
        io: ArrayIO = INLINE,
        data: Iterator[Any] | None = None,
        transport: str | None = None,
        handler: Handler | None = None,
    ) -> Outcome:
        """Run one call; never raises. ``transport`` (grpc / socket / shm) counts the call
        in the session request metrics; unary gRPC is counted by the interceptor.
        ``handler`` runs in place of the call's own (``server/fastpath.py``: a decode
        call's arguments already read and checked in C)."""
        self.last = t0 = time.perf_counter()
        fn = handler or self.handler(call)
        if fn is None:
            out = Outcome(
                None, grpc.StatusCode.UNIMPLEMENTED, f"{call.kind}: not served by this worker"
            )
        else:
            try:
                if call.streams_data:
                    out = Outcome(fn(request, owner, io, data))
                else:
                    out = Outcome(fn(request, owner, io))
            except Exception as exc:
                code, message = status_of(exc, call.kind)
                out = Outcome(None, code, message)
        if transport is not None:
            self.hooks.record_session_request(
                call.kind, out.code, time.perf_counter() - t0, transport
            )
        return out

    def refused(self, kind: str, code: grpc.StatusCode, seconds: float, transport: str) -> None:
        """Count a call a transport refused before it could run (bad slices, sizes)."""
        self.hooks.record_session_request(kind, code, seconds, transport)


__all__ = ["OK", "STATUS_OF", "Dispatch", "Outcome", "status_of"]
