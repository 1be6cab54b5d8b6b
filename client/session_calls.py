"""What every kind of session shares: ``SessionFuture``, the pending result of one call, and
``SessionCalls``, the calls themselves (each built once from ``requests``, submitted through
the transport's ``_submit``), their ``*_sync`` forms and the context manager. Transports:
``Session`` (gRPC stream, shared memory, doorbell) in ``client/session.py``,
``SocketSession`` (the data plane) in ``client/socket_session.py``; ``RecoveringSession``
(``client/recovering_session.py``) wraps either."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from coliworker.client import errors, requests
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec

_S = TypeVar("_S", bound="SessionCalls")
#: Where a response's outside arrays are (``staging.source``), or None.
Source = Callable[[pb.Array], Any] | None
#: Turns a response body into the call's value; gets the future to fill backend_ns/lengths.
Decoder = Callable[[Any, "SessionFuture", Source], Any]


def raw(body: Any, fut: Any, source: Source) -> Any:
    """The decoder of control calls: the response body itself."""
    return body


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


def read_until(
    fut: SessionFuture,
    deadline: float | None,
    reading: threading.Lock,
    read: Callable[[float | None], bool],
) -> None:
    """Read answers on this thread until ``fut`` is done or ``deadline`` (monotonic) passes:
    one waiting thread at a time holds ``reading`` and calls ``read(deadline)``, which
    completes whatever calls it reads and returns False on timeout; the others wait for the
    lock and find their future done."""
    while not fut.done():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not reading.acquire(timeout=-1 if left is None else left):
            return
        try:
            if fut.done():
                return
            if not read(deadline):
                return  # timed out
        finally:
            reading.release()


class WaitingFuture(SessionFuture):
    """The future of a transport with no reader thread: ``result()`` reads the answers on
    the calling thread, through ``waiter.wait(future, timeout)`` (the doorbell channel, the
    socket session)."""

    __slots__ = ("_waiter",)

    def __init__(self, request_id: int, waiter: Any) -> None:
        super().__init__(request_id)
        self._waiter = waiter

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._waiter.wait(self, timeout)
            if not self.done():
                raise errors.DeadlineExceeded(
                    f"session request {self.request_id}: no result after {timeout} s"
                )
        return super().result()


class SessionCalls:
    """The calls of a session (futures), their ``*_sync`` forms (submit, then wait
    ``self.timeout`` for the result) and the context manager. A transport implements
    ``_submit(kind, body, decode, out_bytes, side=None)``: ``body`` is the call's request
    message, its outside arrays (``staged.offset`` = an index) are ``side``, by default the
    ones ``_enc`` staged on this thread (``_take_side``)."""

    #: The calls every session (and ``WorkerClient``, one RPC each) offers.
    OPS = (
        "matmul",
        "expert_mlp",
        "expert_group",
        "expert_group_routed",
        "attention",
        "attention_ragged",
    )

    timeout: float | None
    wire_dtype: int
    _tls: threading.local
    close: Callable[..., None]
    _submit: Callable[..., Any]

    def _take_side(self) -> list[np.ndarray]:
        side: list[np.ndarray] = getattr(self._tls, "side", None) or []
        self._tls.side = []
        return side

    # -- the calls, defined once for every session transport ------------------------------

    def _enc(self, msg: pb.Array, x: np.ndarray, name: str, ndim: int) -> None:
        """Fill ``msg`` (an unset Array field) as an Array whose bytes are placed later by
        ``_place``: until then ``staged`` holds the index of the wire-typed NumPy array in this
        thread's side list."""
        a = np.asarray(x, dtype=np.float32)
        if a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
        if self.wire_dtype == pb.DTYPE_FLOAT32:
            raw = np.ascontiguousarray(a, "<f4")
        elif self.wire_dtype == pb.DTYPE_FLOAT16:
            raw = np.ascontiguousarray(a, "<f2")
        else:
            raw = codec.float32_to_bfloat16_bits(a)
        side = getattr(self._tls, "side", None)
        if side is None:
            side = self._tls.side = []
        side.append(raw)
        msg.dtype = self.wire_dtype
        msg.shape.extend(a.shape)
        staged = msg.staged
        staged.offset = len(side) - 1
        staged.length = raw.nbytes

    @staticmethod
    def _decoder(field: str) -> Decoder:
        def decode(body: Any, fut: SessionFuture, source: Source) -> np.ndarray:
            fut.backend_ns = body.backend_ns
            if hasattr(body, "lengths"):
                fut.lengths = list(body.lengths)
            return codec.decode(getattr(body, field), "result", source=source)

        return decode

    def _go(self, kind: str, body: Any, field: str, out_bytes: int) -> SessionFuture:
        return self._submit(kind, body, self._decoder(field), out_bytes)

    # -- calls (futures) ------------------------------------------------------------------

    def matmul(self, t: Any, x: np.ndarray) -> SessionFuture:
        """x float32 [S, I] -> future of y float32 [S, O]."""
        body = requests.matmul(self._enc, t, x)
        out = body.x.shape[0] * int(getattr(t, "out_features", body.x.shape[1])) * 4
        return self._go("matmul", body, "y", out)

    def expert_mlp(self, gate: Any, up: Any, down: Any, x: np.ndarray) -> SessionFuture:
        """x float32 [S, D] -> future of down(silu(gate x) * up x) float32 [S, D]."""
        body = requests.expert_mlp(self._enc, gate, up, down, x)
        return self._go("expert_mlp", body, "y", math.prod(body.x.shape) * 4)

    def expert_group(
        self, experts: Iterable[Sequence[Any]], rows: Sequence[int], x: np.ndarray
    ) -> SessionFuture:
        """The packed form: x float32 [sum(rows), D], rows[c] rows for expert c -> future
        of y float32 packed the same way."""
        body = requests.expert_group(self._enc, experts, rows, x)
        return self._go("expert_group", body, "y", math.prod(body.x.shape) * 4)

    def expert_group_routed(
        self,
        experts: Iterable[Sequence[Any]],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> SessionFuture:
        """x float32 [T, D] (each token once); routes int [T, K] into experts; weights
        float32 [T, K] -> future of y[t] = sum_j weights[t, j] * expert_{routes[t, j]}(x[t])."""
        body = requests.expert_group_routed(self._enc, experts, x, routes, weights)
        return self._go("expert_group_routed", body, "y", math.prod(body.x.shape) * 4)

    def attention(
        self,
        kv_b: Any,
        q: np.ndarray,
        latent: np.ndarray,
        rope: np.ndarray,
        *,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        o_proj: Any = None,
    ) -> SessionFuture:
        """Causal MLA over one sequence (as ``WorkerClient.attention``), as a future."""
        body = requests.attention(
            self._enc,
            kv_b,
            q,
            latent,
            rope,
            q_dim=q_dim,
            rope_dim=rope_dim,
            v_dim=v_dim,
            scale=scale,
            o_proj=o_proj,
        )
        return self._go("attention", body, "out", self._att_out(body.q, v_dim, o_proj))

    def attention_ragged(
        self,
        kv_b: Any,
        o_proj: Any,
        q: np.ndarray,
        *,
        sequences: Sequence[tuple[int, int, np.ndarray, np.ndarray]],
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
    ) -> SessionFuture:
        """Ragged MLA over resident KV (as ``WorkerClient.attention_ragged``), as a future;
        ``future.lengths`` holds the resident lengths once done. Calls on one kv_b run in
        the order submitted."""
        body = requests.attention_ragged(
            self._enc,
            kv_b,
            o_proj,
            q,
            sequences=sequences,
            q_dim=q_dim,
            rope_dim=rope_dim,
            v_dim=v_dim,
            scale=scale,
        )
        return self._go("attention_ragged", body, "out", self._att_out(body.q, v_dim, o_proj))

    @staticmethod
    def _att_out(qa: pb.Array, v_dim: int, o_proj: Any) -> int:
        s, h = int(qa.shape[0]), int(qa.shape[1])
        width = int(getattr(o_proj, "out_features", 0)) or h * v_dim
        return s * max(width, h * v_dim) * 4

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


__all__ = ["SessionCalls", "SessionFuture", "WaitingFuture", "read_until"]
