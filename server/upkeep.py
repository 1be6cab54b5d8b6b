"""The worker's upkeep, off the calls' path: one thread that folds the hot path's journals (the
metrics' and the usage counts' records) in small pieces between calls, and keeps what the
worker holds for long out of Python's automatic garbage collections.

    Upkeep(last_call, folds).start()  ...  .stop()

**Folds.** A call records its metrics and usage as journal entries (``server/tally.py``,
``server/usage.py``); the call that finds a journal ``JOURNAL`` entries long applies them all
at once, a few milliseconds in one call in about a thousand. Every ``TICK`` seconds the
upkeep applies what waits, ``PIECE`` entries of each journal at a time (each ``fold(most)``
in ``folds``, returning how many it applied), letting the other threads run between pieces;
a decode call waits for the GPU with the GIL released, which is when these run.

**Garbage collection.** CPython's full collection walks every object it tracks, in whichever
call's allocation crosses its threshold. With a model's experts uploaded (about 15 tracked
objects an expert: GLM-5.2's 20k experts make about 300k) one takes tens to hundreds of
milliseconds, every few tens of thousands of calls (``bench/call_pauses.py``). Every
``INTERVAL`` seconds ``gc.freeze()`` (constant time) moves what is tracked into the permanent
generation, which the automatic collections skip: they walk only what was made since.
Garbage cycles frozen with it (a decode call makes none; an error's traceback can) are
reclaimed by a *settle*, ``gc.unfreeze(); gc.collect(); gc.freeze()``: the one full
collection, made once the worker has started no call for ``QUIET`` seconds after being busy,
and at the latest ``LONGEST`` seconds after the last settle (so what a worker that is never
idle freezes is bounded by what it makes in that time). ``last_call()`` is the
``time.perf_counter()`` of the latest call started (``Dispatch.last``). The freezing is
process-wide: the last upkeep to stop unfreezes (the objects return to the oldest
generation). ``COLIWORKER_GC_FREEZE=0`` leaves the collector as Python has it;
``COLIWORKER_FOLD_AHEAD=0`` leaves the journals to the calls and the readers.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

FREEZE = os.environ.get("COLIWORKER_GC_FREEZE", "1") != "0"
FOLD_AHEAD = os.environ.get("COLIWORKER_FOLD_AHEAD", "1") != "0"
#: Seconds between folds.
TICK = 0.02
#: Entries of a journal applied before the other threads get a turn.
PIECE = 64
#: Pieces a fold makes at most in one tick (a journal filling faster is left to its calls).
PIECES = 64
#: Seconds between freezes.
INTERVAL = 1.0
#: Seconds without a call started before a settle.
QUIET = 5.0
#: Most seconds between settles, busy or not.
LONGEST = 600.0

_lock = threading.Lock()
_freezing = 0  # upkeeps started with FREEZE and not stopped, in this process


class Upkeep:
    """One worker's upkeep thread (see the module docstring)."""

    def __init__(
        self,
        last_call: Callable[[], float],
        folds: Sequence[Callable[[int], int]] = (),
        interval: float = INTERVAL,
        quiet: float = QUIET,
        longest: float = LONGEST,
        tick: float = TICK,
    ) -> None:
        self.last_call = last_call
        self.folds = tuple(folds) if FOLD_AHEAD else ()
        self.freezes = FREEZE
        self.interval, self.quiet, self.longest, self.tick = interval, quiet, longest, tick
        self.settles = 0  # settles made
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._settled = time.perf_counter()  # when the last settle was made

    def start(self) -> Upkeep:
        global _freezing
        if (not self.folds and not self.freezes) or self._thread is not None:
            return self
        if self.freezes:
            with _lock:
                _freezing += 1
        self._thread = threading.Thread(target=self._run, name="coliworker-upkeep", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        global _freezing
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        if self.freezes:
            with _lock:
                _freezing -= 1
                if not _freezing:
                    gc.unfreeze()

    def _run(self) -> None:
        due = time.perf_counter() + self.interval
        while not self._stop.wait(self.tick):
            self.fold()
            now = time.perf_counter()
            if self.freezes and now >= due:
                self.step(now)
                due = now + self.interval

    def fold(self) -> None:
        """Apply what the journals hold, ``PIECE`` entries of each at a time (at most
        ``PIECES`` pieces), the other threads let run between pieces."""
        for _ in range(PIECES):
            if not sum(fold(PIECE) for fold in self.folds):
                return
            time.sleep(0)  # (releases the GIL: a call waiting for it goes first)

    def step(self, now: float) -> None:
        """One turn of the collection's upkeep: a settle where it is due, else a freeze."""
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


__all__ = ["FOLD_AHEAD", "FREEZE", "INTERVAL", "LONGEST", "PIECE", "QUIET", "TICK", "Upkeep"]
