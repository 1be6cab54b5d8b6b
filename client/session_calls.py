"""What every kind of session shares: ``SessionFuture``, the pending result of one call, and
``SessionCalls``, the ``*_sync`` forms of the calls and the context manager (``Session`` in
``client/session.py``, ``RecoveringSession`` in ``client/recovering_session.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from coliworker.client import errors

_S = TypeVar("_S", bound="SessionCalls")


class SessionFuture:
    """The pending result of one session call. ``backend_ns`` (and ``lengths`` for ragged
    attention) are set once it is done."""

    __slots__ = ("request_id", "_done", "_value", "_error", "backend_ns", "lengths", "_regions")

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._done = threading.Lock()
        self._done.acquire()
        self._value: Any = None
        self._error: BaseException | None = None
        self.backend_ns = 0
        self.lengths: list[int] = []
        self._regions: list[tuple[int, int]] = []

    def done(self) -> bool:
        return not self._done.locked()

    def result(self, timeout: float | None = None) -> Any:
        """The decoded result; raises the call's WorkerError, or DeadlineExceeded after
        ``timeout`` seconds (the call itself keeps running)."""
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            raise errors.DeadlineExceeded(
                f"session request {self.request_id}: no result after {timeout} s"
            )
        self._done.release()
        if self._error is not None:
            raise self._error
        return self._value

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.release()


class SessionCalls:
    """What ``Session`` and the recovering session share: the ``*_sync`` forms of the calls
    (submit, then wait ``self.timeout`` for the result) and the context manager."""

    timeout: float | None
    matmul: Callable[..., Any]
    expert_mlp: Callable[..., Any]
    expert_group: Callable[..., Any]
    expert_group_routed: Callable[..., Any]
    attention: Callable[..., Any]
    attention_ragged: Callable[..., Any]
    close: Callable[..., None]

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def matmul_sync(self, t: Any, x: np.ndarray) -> np.ndarray:
        return self.matmul(t, x).result(self.timeout)

    def expert_mlp_sync(self, gate: Any, up: Any, down: Any, x: np.ndarray) -> np.ndarray:
        return self.expert_mlp(gate, up, down, x).result(self.timeout)

    def expert_group_sync(
        self, experts: Iterable[Sequence[Any]], rows: Sequence[int], x: np.ndarray
    ) -> np.ndarray:
        return self.expert_group(experts, rows, x).result(self.timeout)

    def expert_group_routed_sync(
        self,
        experts: Iterable[Sequence[Any]],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        return self.expert_group_routed(experts, x, routes, weights).result(self.timeout)

    def attention_sync(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return self.attention(*args, **kwargs).result(self.timeout)

    def attention_ragged_sync(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return self.attention_ragged(*args, **kwargs).result(self.timeout)


__all__ = ["SessionCalls", "SessionFuture"]
