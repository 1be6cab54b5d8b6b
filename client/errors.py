"""Errors the client raises: one class per gRPC status, carrying the worker's message.

    WorkerError                 base: .code (grpc.StatusCode), .message
    ├── InvalidArgument         the request was malformed (field and values in the message)
    ├── NotFound                unknown or freed handle / ticket
    ├── FailedPrecondition      state does not allow it (KV start past resident rows, evicted)
    ├── ResourceExhausted       device memory, budgets, limits
    ├── Unavailable             worker unreachable or compute failed: fall back to the CPU path
    │   └── WorkerRestarted     the worker restarted and its resident state could not be
    │                           restored (RecoveringClient without retain/loader): CPU path
    ├── DeadlineExceeded        the call ran past its deadline
    ├── Cancelled               the call was cancelled
    ├── Unauthenticated         missing or wrong token
    ├── PermissionDenied        another owner's object
    └── InternalError           a worker bug (the message has a request id for its log)

Transport internals are hidden (``raise ... from None``).
"""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """A call failed; ``code`` is the gRPC status, ``message`` the worker's explanation."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(WorkerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(WorkerError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(WorkerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(WorkerError):
    code = grpc.StatusCode.UNAVAILABLE


class WorkerRestarted(Unavailable):
    """The worker restarted (new instance id): its tensors, KV caches and tickets are gone
    and this client had no means to restore them. Fall back to the CPU path (the seed's
    "return 0"), or re-upload and carry on."""


class DeadlineExceeded(WorkerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(WorkerError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(WorkerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WorkerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(WorkerError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[WorkerError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unauthenticated,
        PermissionDenied,
        InternalError,
    )
}


def from_status(code: grpc.StatusCode, message: str) -> WorkerError:
    """The WorkerError subclass for a status code and the worker's message."""
    return _BY_CODE.get(code, WorkerError)(message or code.name, code)


def from_rpc_error(err: grpc.RpcError) -> WorkerError:
    """The WorkerError subclass for a failed call."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return from_status(code, details)


__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "WorkerError",
    "WorkerRestarted",
    "from_rpc_error",
    "from_status",
]
