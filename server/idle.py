"""Streams that go quiet are ended: a stalled upload or an idle Session must not hold a
thread forever.

``IdleWatchdog.watch(on_idle)`` returns a ``Watch``; the stream calls ``touch()`` whenever
something arrives and ``close()`` when it ends. A watch not touched for ``timeout`` seconds
gets ``on_idle()`` called once, from the watchdog's thread (for gRPC: ``context.cancel``,
which wakes the handler blocked reading the stream with an error, or ``end_stream`` to say
why; for a socket: closing it), unless its ``busy()`` says a call is still running (then it
counts as touched). One thread serves every watch; it runs only while there are watches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class Watch:
    __slots__ = ("_dog", "busy", "last", "on_idle", "what")

    def __init__(
        self,
        dog: IdleWatchdog,
        on_idle: Callable[[], None],
        what: str,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self._dog, self.on_idle, self.what, self.busy = dog, on_idle, what, busy
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def close(self) -> None:
        self._dog._drop(self)


class IdleWatchdog:
    """Calls ``on_idle`` of every watch untouched for ``timeout`` seconds (0: never)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None

    def watch(
        self,
        on_idle: Callable[[], None],
        what: str = "stream",
        busy: Callable[[], bool] | None = None,
    ) -> Watch:
        w = Watch(self, on_idle, what, busy)
        if self.timeout <= 0:
            return w
        with self._lock:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="idle-watch", daemon=True)
                self._thread.start()
        return w

    def _drop(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        period = min(1.0, max(0.05, self.timeout / 4))
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._watches if now - w.last > self.timeout]
                for w in [w for w in idle if w.busy is not None and w.busy()]:
                    w.touch()  # a call is running: not idle
                    idle.remove(w)
                self._watches.difference_update(idle)
                if not self._watches and not idle:
                    self._thread = None
                    return
            for w in idle:
                log.info("%s: nothing received for %.0f s, ending it", w.what, self.timeout)
                try:
                    w.on_idle()
                except Exception:  # a stream that ended meanwhile
                    log.debug("ending an idle %s failed", w.what, exc_info=True)


def end_stream(context: Any, code: grpc.StatusCode, details: str) -> None:
    """End a gRPC stream with this status from any thread (the watchdog's). gRPC's Python
    server has no public way: ``context.abort`` works only on the handler's thread, which
    may be blocked reading the stream, and ``context.cancel()`` alone reports CANCELLED with
    no reason. The server call's ``cancel(code, details)`` (gRPC core's
    ``grpc_call_cancel_with_status``) reports both; where it is missing, CANCELLED it is."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except Exception:  # another gRPC: no such call object
        log.debug("ending a stream with %s: no call object, cancelling", code, exc_info=True)
        context.cancel()


__all__ = ["IdleWatchdog", "Watch", "end_stream"]
