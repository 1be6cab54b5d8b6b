"""Streams that go quiet are ended: a stalled upload must not hold a thread forever.

``IdleWatchdog.watch(on_idle)`` returns a ``Watch``; the stream calls ``touch()`` whenever
something arrives and ``close()`` when it ends. A watch not touched for ``timeout`` seconds
gets ``on_idle()`` called once, from the watchdog's thread (for gRPC: ``context.cancel``,
which wakes the handler blocked reading the stream with an error; for a socket: closing
it). One thread serves every watch; it runs only while there are watches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watch:
    __slots__ = ("_dog", "last", "on_idle", "what")

    def __init__(self, dog: IdleWatchdog, on_idle: Callable[[], None], what: str) -> None:
        self._dog, self.on_idle, self.what = dog, on_idle, what
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

    def watch(self, on_idle: Callable[[], None], what: str = "stream") -> Watch:
        w = Watch(self, on_idle, what)
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


__all__ = ["IdleWatchdog", "Watch"]
