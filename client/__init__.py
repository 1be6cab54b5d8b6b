"""The Python client of a coliworker.

from coliworker.client import WorkerClient, WorkerError
with WorkerClient("127.0.0.1:50051") as w:
    t = w.upload(weights, scales, fmt=2, in_features=I, out_features=O)
    y = w.matmul(t, x)
"""

from coliworker.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WorkerError,
    WorkerRestarted,
)
from coliworker.client.pool import PoolRef, WorkerPool
from coliworker.client.recovery import RecoveringClient
from coliworker.client.security import TLS
from coliworker.client.session import Session
from coliworker.client.session_calls import SessionFuture
from coliworker.client.worker import (
    DeviceStats,
    ExpertGroupFuture,
    TensorRef,
    UploadItem,
    WorkerClient,
    WorkerInfo,
)

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "DeviceStats",
    "ExpertGroupFuture",
    "FailedPrecondition",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "PoolRef",
    "RecoveringClient",
    "ResourceExhausted",
    "TLS",
    "Session",
    "SessionFuture",
    "TensorRef",
    "Unauthenticated",
    "Unavailable",
    "UploadItem",
    "WorkerClient",
    "WorkerError",
    "WorkerInfo",
    "WorkerPool",
    "WorkerRestarted",
]
