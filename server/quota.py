"""Per-owner memory quotas: the bytes each owner (token) keeps resident.

``Quota`` charges each owner (one per token; "" when authentication is off) for the
resident bytes it holds: a tensor's bytes once per distinct content it references, however
many handles it holds on it (identical uploads share one copy; each owner holding it pays
for it, so an owner never depends on another keeping a copy alive), plus the capacity of its
KV caches. Tensor bytes are reserved *before* the backend allocates, so no request makes the
worker allocate past an owner's quota; KV growth is reserved before the caches grow.
"""

from __future__ import annotations

import threading
from typing import Any

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
        if not self.limit:  # unlimited (``limit`` is fixed at construction): no lock needed
            return
        with self._lock:
            if self._used.get(owner, 0) + nbytes > self.limit:
                self._add(owner, nbytes, what)  # raises, naming the numbers

    def charge(self, owner: str, nbytes: int) -> bool:
        """Account bytes already allocated; False when the owner is now over its quota."""
        with self._lock:
            used = self._used.get(owner, 0) + nbytes
            self._used[owner] = used
            return not self.limit or used <= self.limit

    def discharge(self, owner: str, nbytes: int) -> None:
        with self._lock:
            self._sub(owner, nbytes)


__all__ = ["Quota"]
