"""``PoolSession``: the session of a ``WorkerPool`` (``client/pool.py``).

    with pool.session(transport="socket") as s:
        futs = [s.expert_group_routed(layer_experts[l], x, routes, w) for l in layers]
        ys = [f.result() for f in futs]        # the layers' members work at once

One member session per worker, opened with the same transport and options (a member that
is down when the session opens gets its session once it answers); each call is routed as
the pool routes it (where its tensors are; a call mixing workers is refused) and returns
that member session's future, wrapped so that an ``Unavailable`` tells the pool the member
may be down. A plain member's session that failed is opened anew on the next call once the
member answers; a recovering member's session (``RecoveringSession``) replays its calls in
flight itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coliworker.client import errors
from coliworker.client.pool_routes import on_session
from coliworker.client.session_calls import SessionCalls

if TYPE_CHECKING:
    from coliworker.client.pool import WorkerPool, _Member


class PoolFuture:
    """The pending result of one pool session call (``SessionFuture``'s API)."""

    __slots__ = ("_session", "_member", "_inner", "_fut")

    def __init__(self, session: PoolSession, member: _Member, inner: Any, fut: Any) -> None:
        self._session, self._member, self._inner, self._fut = session, member, inner, fut

    @property
    def request_id(self) -> int:
        return int(self._fut.request_id)

    @property
    def backend_ns(self) -> int:
        return int(self._fut.backend_ns)

    @property
    def lengths(self) -> list[int]:
        return list(self._fut.lengths)

    @property
    def worker(self) -> int:
        """The member the call runs on."""
        return self._member.index

    def done(self) -> bool:
        return bool(self._fut.done())

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._fut.result(timeout)
        except errors.Unavailable as err:
            self._session._lost(self._member, self._inner, err)
            raise


class PoolSession(SessionCalls):
    """Member sessions behind one set of session calls (see the module docstring)."""

    def __init__(self, pool: WorkerPool, transport: str | None = None, **options: Any) -> None:
        self._pool = pool
        self._open_options = dict(options)
        if transport is not None:
            self._open_options["transport"] = transport
        self._lock = threading.Lock()
        # member -> (what its session was opened for (``_key``), session)
        self._sessions: dict[int, tuple[tuple[int, int], Any]] = {}
        self._closed = False
        try:
            for m in pool.members:
                if pool.up(m.index):
                    self._session(m)
        except BaseException:
            self.close()
            raise
        first = next(iter(self._sessions.values()), None)
        self.timeout = options.get("timeout", first[1].timeout if first else 120.0)

    # -- member sessions ------------------------------------------------------------------

    def _key(self, m: _Member) -> tuple[int, int]:
        """A session is opened anew when its member was re-pointed, and for a plain
        member when it came back after being down (its old stream died with it)."""
        return m.generation, 0 if self._pool.recovering else m.revived

    def _session(self, m: _Member) -> Any:
        self._pool._ready(m)  # a member that is down raises Unavailable here, at once
        got = self._sessions.get(m.index)
        key = self._key(m)
        if got is not None and got[0] == key:
            return got[1]
        with self._lock:
            if self._closed:
                raise errors.Cancelled("session is closed")
            got = self._sessions.get(m.index)
            if got is not None and got[0] == key:
                return got[1]
            if got is not None:
                got[1].close(1.0)
            try:
                s = m.client.session(**self._open_options)
            except errors.Unavailable as err:
                self._pool._failed(m, err)
                raise
            self._sessions[m.index] = (key, s)
            return s

    def _lost(self, m: _Member, session: Any, err: errors.WorkerError) -> None:
        """A call on ``m``'s ``session`` raised Unavailable: the pool checks the member; a
        plain member's session is opened anew next time (a recovering one recovers)."""
        self._pool._failed(m, err)
        if self._pool.recovering:
            return
        with self._lock:
            got = self._sessions.get(m.index)
            if got is not None and got[1] is session:
                del self._sessions[m.index]
                try:
                    session.close(0.1)
                except Exception:
                    pass

    def _go(self, m: _Member, send: Callable[[Any], Any]) -> PoolFuture:
        s = self._session(m)
        try:
            fut = send(s)
        except errors.Unavailable as err:
            self._lost(m, s, err)
            raise
        return PoolFuture(self, m, s, fut)

    @property
    def transport(self) -> str:
        """The member sessions' transport ("socket"), or theirs joined with ',' if they
        differ (``"auto"`` may pick shm for a member on this host)."""
        names = sorted({str(s.transport) for _, s in self._sessions.values()})
        return ",".join(names)

    def close(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._closed = True
            sessions = [s for _, s in self._sessions.values()]
            self._sessions.clear()
        for s in sessions:
            try:
                s.close(timeout)
            except Exception:
                pass

    # -- calls (futures; the *_sync forms and the context manager are SessionCalls') ------

    matmul = on_session("matmul")
    expert_mlp = on_session("expert_mlp")
    expert_group = on_session("expert_group")
    expert_group_routed = on_session("expert_group_routed")
    attention = on_session("attention")
    attention_ragged = on_session("attention_ragged")


__all__ = ["PoolFuture", "PoolSession"]
