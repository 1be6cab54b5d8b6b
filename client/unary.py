"""The session calls over unary RPCs: what ``WorkerClient``'s compute methods run on.

``UnaryCalls`` is a transport like the sessions (``SessionCalls`` defines each call once):
its ``_submit`` puts the call's arrays inside the request message and makes the one RPC, so
the future it returns is already done. ``sync`` turns a session call into the blocking
``WorkerClient`` method of the same name (the value, with ``backend_ns`` and the ragged
``lengths`` in ``last_call``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from coliworker.client.session_calls import Decoder, SessionCalls, SessionFuture, raw
from coliworker.wire import calls, staging


class UnaryCalls(SessionCalls):
    transport = "unary"

    def __init__(self, client: Any) -> None:
        self._client = client
        self._tls = threading.local()

    @property
    def wire_dtype(self) -> int:  # type: ignore[override]
        return self._client.wire_dtype

    @property
    def timeout(self) -> float | None:  # type: ignore[override]
        return self._client.timeout

    def close(self, timeout: float | None = None) -> None:
        pass

    def _submit(
        self,
        kind: str,
        body: Any,
        decode: Decoder | None,
        out_bytes: int = 0,
        side: list[np.ndarray] | None = None,
    ) -> SessionFuture:
        staging.inline(body, self._take_side() if side is None else side)
        c = self._client
        resp = c._call(getattr(c._stub, calls.BY_KIND[kind].name), body)
        fut = SessionFuture(0)
        fut._set((decode or raw)(resp, fut, None))
        return fut


def sync(name: str) -> Callable[..., Any]:
    """The blocking client method of session call ``name`` (see the module docstring)."""
    op = getattr(SessionCalls, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        fut = op(self._unary, *args, **kwargs)
        info = self.last_call
        info.backend_ns = fut.backend_ns
        if name == "attention_ragged":
            info.lengths = list(fut.lengths)
        return fut.result()

    method.__name__ = method.__qualname__ = name
    doc = (op.__doc__ or "").replace("future of ", "")
    method.__doc__ = doc + "\n\nOne unary RPC; ``last_call`` has its backend_ns (and lengths)."
    return method


__all__ = ["UnaryCalls", "sync"]
