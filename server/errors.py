"""The worker's error hierarchy: one class per gRPC status, turned into a status in ONE place.

    WorkerError                      (INTERNAL, generic message; logged with a request id)
    ├── InvalidArgument              INVALID_ARGUMENT    bad shape, length, format, value
    ├── NotFound                     NOT_FOUND           unknown or freed handle / ticket
    ├── FailedPrecondition           FAILED_PRECONDITION state does not allow it (KV start
    │                                                    past the resident rows, evicted)
    ├── ResourceExhausted            RESOURCE_EXHAUSTED  device memory, budgets, limits
    ├── Unavailable                  UNAVAILABLE         compute failed (fault, draining);
    │                                                    the engine falls back to its CPU
    ├── Unauthenticated              UNAUTHENTICATED     missing or wrong token
    └── PermissionDenied             PERMISSION_DENIED   another owner's tensor/sequence

Messages name the field and both values: ``"matmul.x: expected 6144 columns (tensor
in_features), got 4096"``. Request data is never checked with ``assert``.
"""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """Base class; raised directly it means an internal error (INTERNAL)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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


class Unauthenticated(WorkerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WorkerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class OutOfDeviceMemory(ResourceExhausted):
    """A device allocation failed; the call is refused and nothing resident changes."""


__all__ = [
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "OutOfDeviceMemory",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "WorkerError",
]
