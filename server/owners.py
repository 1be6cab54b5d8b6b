"""Per-owner limits on what a stream holds: open sessions, uploads in progress, staged bytes.

A Session stream and an upload (Upload / Update) each hold one of the server's ``--workers``
threads for as long as they are open, and staged bytes (an upload's host receive buffer, a
session's chunks of a request not yet run) are host memory outside every device budget. So
each owner (token; "" when authentication is off) may hold at most:

- ``sessions`` open Session streams (``--max-sessions-per-owner``),
- ``uploads`` uploads in progress (``--max-uploads-per-owner``),
- ``staged_bytes`` bytes staged on the host (``--max-staged-bytes-per-owner``),

and all owners together at most ``streams`` thread-holding streams (sessions + uploads):
``--workers`` minus ``RESERVED_THREADS``, so that unary calls and health checks always find
a thread however many streams are open; one owner at most half of them, so that no single
owner takes the streams of all others. A refusal is RESOURCE_EXHAUSTED naming the limit and
changes nothing. Every transport uses the same object (``WorkerServicer.owners``):

    with servicer.owners.open_session(owner):      # the whole life of a Session stream
        ...
    return servicer.owners.session_stream(owner, context, lambda: serve(...))  # gRPC
    with servicer.owners.upload(owner):            # one upload, header to response
        with servicer.owners.staged(owner, nbytes, "update"):   # a host buffer's life
            ...
    servicer.owners.stage(owner, n, what) / servicer.owners.unstage(owner, n)
                                                   # bytes whose life is not one block
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from coliworker.server.errors import ResourceExhausted

#: Threads of the gRPC pool that streams may never take (unary calls, health, refusals).
RESERVED_THREADS = 4


def stream_limit(workers: int) -> int:
    """How many thread-holding streams all owners together may keep open."""
    return max(1, workers - RESERVED_THREADS)


class OwnerLimits:
    """Counts per owner (see the module docstring); 0 for a limit means unlimited."""

    def __init__(self, sessions: int, uploads: int, staged_bytes: int, streams: int) -> None:
        self.sessions, self.uploads, self.staged_bytes = sessions, uploads, staged_bytes
        self.streams = streams
        self._lock = threading.Lock()
        self._sessions: dict[str, int] = {}
        self._uploads: dict[str, int] = {}
        self._staged: dict[str, int] = {}
        self._open = 0  # sessions + uploads of every owner

    @staticmethod
    def _who(owner: str) -> str:
        return f"owner {owner!r}" if owner else "this client"

    def _enter(self, counts: dict[str, int], limit: int, owner: str, what: str, flag: str) -> None:
        with self._lock:
            n = counts.get(owner, 0)
            if limit and n >= limit:
                raise ResourceExhausted(
                    f"{what}: {self._who(owner)} has {n} open, limit {limit} ({flag}); "
                    f"close some first"
                )
            mine = self._sessions.get(owner, 0) + self._uploads.get(owner, 0)
            share = max(1, self.streams // 2)
            if mine >= share:
                raise ResourceExhausted(
                    f"{what}: {self._who(owner)} has {mine} sessions and uploads open, the most "
                    f"one owner may hold (half of the {self.streams} the worker allows: "
                    f"--workers minus {RESERVED_THREADS}); close some first"
                )
            if self._open >= self.streams:
                raise ResourceExhausted(
                    f"{what}: the worker has {self._open} sessions and uploads open, limit "
                    f"{self.streams} (--workers minus {RESERVED_THREADS} threads kept for "
                    f"calls); try again later"
                )
            counts[owner] = n + 1
            self._open += 1

    def _leave(self, counts: dict[str, int], owner: str) -> None:
        with self._lock:
            n = counts.get(owner, 0) - 1
            if n > 0:
                counts[owner] = n
            else:
                counts.pop(owner, None)
            self._open -= 1

    @contextlib.contextmanager
    def open_session(self, owner: str) -> Iterator[None]:
        """Hold one of ``owner``'s sessions for the body (the stream's whole life)."""
        self._enter(self._sessions, self.sessions, owner, "session", "--max-sessions-per-owner")
        try:
            yield
        finally:
            self._leave(self._sessions, owner)

    def session_stream(
        self, owner: str, context: Any, serve: Callable[[], Iterator[Any]]
    ) -> Iterator[Any]:
        """A gRPC Session stream's responses, ``serve()``, counted as one of ``owner``'s open
        sessions until they end; refused (RESOURCE_EXHAUSTED, ``serve`` never called) past
        the limits."""
        try:
            self._enter(self._sessions, self.sessions, owner, "session", "--max-sessions-per-owner")
        except ResourceExhausted as exc:
            context.abort(exc.code, exc.message)
        try:
            responses = serve()
        except BaseException:
            self._leave(self._sessions, owner)
            raise
        return self._until_end(responses, owner)

    def _until_end(self, responses: Iterator[Any], owner: str) -> Iterator[Any]:
        try:
            yield from responses
        finally:
            self._leave(self._sessions, owner)

    @contextlib.contextmanager
    def upload(self, owner: str, op: str = "upload") -> Iterator[None]:
        """Hold one of ``owner``'s uploads in progress for the body."""
        self._enter(self._uploads, self.uploads, owner, op, "--max-uploads-per-owner")
        try:
            yield
        finally:
            self._leave(self._uploads, owner)

    def stage(self, owner: str, nbytes: int, what: str) -> None:
        """Admit ``nbytes`` of host memory staged for ``owner`` (``unstage`` gives it back)."""
        with self._lock:
            held = self._staged.get(owner, 0)
            if self.staged_bytes and held + nbytes > self.staged_bytes:
                raise ResourceExhausted(
                    f"{what}: needs {nbytes} bytes staged on the host, {self._who(owner)} "
                    f"holds {held} of its {self.staged_bytes} (--max-staged-bytes-per-owner)"
                )
            self._staged[owner] = held + nbytes

    def unstage(self, owner: str, nbytes: int) -> None:
        with self._lock:
            left = self._staged.get(owner, 0) - nbytes
            if left > 0:
                self._staged[owner] = left
            else:
                self._staged.pop(owner, None)

    @contextlib.contextmanager
    def staged(self, owner: str, nbytes: int, what: str) -> Iterator[None]:
        """``stage`` for the body, ``unstage`` after it."""
        self.stage(owner, nbytes, what)
        try:
            yield
        finally:
            self.unstage(owner, nbytes)

    def held(self, owner: str) -> tuple[int, int, int]:
        """(open sessions, uploads in progress, staged bytes) of ``owner``."""
        with self._lock:
            return (
                self._sessions.get(owner, 0),
                self._uploads.get(owner, 0),
                self._staged.get(owner, 0),
            )


def owner_limits(config: Any) -> OwnerLimits:
    """The limits of a worker ``Config``."""
    return OwnerLimits(
        config.max_sessions_per_owner,
        config.max_uploads_per_owner,
        config.max_staged_bytes_per_owner,
        stream_limit(config.workers),
    )


__all__ = ["RESERVED_THREADS", "OwnerLimits", "owner_limits", "stream_limit"]
