"""The worker's garbage collection: what it keeps for long (the resident tensors' records, the
plans, the caches) is kept out of Python's automatic collections, so that no call waits for a
full collection of it.

CPython's full collection walks every object it tracks, in whichever call's allocation
crosses its threshold. With a model's experts uploaded (about 15 tracked objects an expert:
GLM-5.2's 20k experts make about 300k) one takes tens to hundreds of milliseconds, and it
comes every few tens of thousands of calls: one decode call in so many waits that long
(``bench/gc_pauses.py``).

    Keeper(last_call).start()  ...  .stop()

While a keeper runs, every ``INTERVAL`` seconds ``gc.freeze()`` (constant time) moves what is
tracked into the permanent generation, which the automatic collections skip: they walk only
what was made since. Garbage cycles frozen with it (a decode call makes none; an error's
traceback can) are reclaimed by a *settle*, ``gc.unfreeze(); gc.collect(); gc.freeze()``: the
one full collection, made once the worker has started no call for ``QUIET`` seconds after
being busy, and at the latest ``LONGEST`` seconds after the last settle (so what a worker
that is never idle freezes is bounded by what it makes in that time). ``last_call()`` is the
``time.perf_counter()`` of the latest call started (``Dispatch.last``).

The freezing is process-wide: the last keeper to stop unfreezes (the objects return to the
oldest generation). ``COLIWORKER_GC_FREEZE=0`` leaves the collector as Python has it.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

ENABLED = os.environ.get("COLIWORKER_GC_FREEZE", "1") != "0"
#: Seconds between freezes.
INTERVAL = 1.0
#: Seconds without a call started before a settle.
QUIET = 5.0
#: Most seconds between settles, busy or not.
LONGEST = 600.0

_lock = threading.Lock()
_running = 0  # keepers started and not stopped, in this process


class Keeper:
    """One worker's garbage-collection thread (see the module docstring)."""

    def __init__(
        self,
        last_call: Callable[[], float],
        interval: float = INTERVAL,
        quiet: float = QUIET,
        longest: float = LONGEST,
    ) -> None:
        self.last_call = last_call
        self.interval, self.quiet, self.longest = interval, quiet, longest
        self.settles = 0  # settles made
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._settled = time.perf_counter()  # when the last settle was made

    def start(self) -> Keeper:
        global _running
        if not ENABLED or self._thread is not None:
            return self
        with _lock:
            _running += 1
        self._thread = threading.Thread(target=self._run, name="coliworker-heap", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        global _running
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        with _lock:
            _running -= 1
            if not _running:
                gc.unfreeze()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.step(time.perf_counter())

    def step(self, now: float) -> None:
        """One turn: a settle where it is due, else a freeze."""
        busy_since_settle = self.last_call() > self._settled
        quiet = now - self.last_call() >= self.quiet
        if (busy_since_settle and quiet) or now - self._settled >= self.longest:
            self.settle(now)
        else:
            gc.freeze()

    def settle(self, now: float | None = None) -> None:
        """The full collection: every object back in the collector's reach, collected, and
        what is left frozen again."""
        t0 = time.perf_counter()
        with _lock:  # (one settle at a time in the process)
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
        self._settled = time.perf_counter() if now is None else now
        self.settles += 1
        log.debug(
            "heap settled: %d unreachable objects collected, %d kept, %.1f ms",
            found,
            gc.get_freeze_count(),
            (time.perf_counter() - t0) * 1e3,
        )


__all__ = ["ENABLED", "INTERVAL", "LONGEST", "QUIET", "Keeper"]
