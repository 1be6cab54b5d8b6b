"""CUDA graphs of the CuPy backend's calls: a call's device work, recorded once, replayed.

A call (``Call`` in ``server/cupy_calls.py``) does not issue its device work as it goes: it
lists it (copies between its arena's pinned host half and its device half, kernel launches,
its timing events: one after all where the copy kernels stamp the phases, else four) and
issues the list at the end. The list is a value: the same operation with
the same shapes in the same arena gives the same list, since every pointer in it lies in
that arena or a resident tensor, and every per-call value (activations, job tables, KV
descriptors) is data the inputs' copy brings. So the list is the key of a CUDA graph: the
second time an arena sees a list, the list is captured into a graph (stream capture, relaxed
mode: other threads keep working); from then on the call is one ``cudaGraphLaunch`` (~0.7 us
of GPU time per node instead of ~6 us of host time per CuPy launch, and one runtime call
instead of a dozen). The replay runs the same kernels with the same parameters on the same
bytes as the direct launches it was captured from: the same bits (``tests/kernels``).

Timing events become event-record nodes (``cuEventRecordWithFlags``, external): the phases
(H2D, kernels, D2H) of a replayed call are read as before. Where the driver lacks that entry
point, or capture fails, calls keep the direct launches (logged once). A list holding a
launch whose arguments are not plain values (a CuPy kernel called with arrays) or a copy
from a client's shared-memory segment is never captured.

An op whose plan fixes its work list (the plans kept per arena and call shape) keeps the graph
``run`` returns with the plan (``Replay`` in ``server/cupy_calls.py``): its later calls launch
it straight away, with no list built or looked up here.

An arena's graphs live as long as its buffers: the arena drops them when it reallocates or
hands its host buffer to a result (``Arena.reserve``, ``Call.finish``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import cupy

log = logging.getLogger(__name__)

#: Off: every call issues its work directly (the reference for the graph tests).
ENABLED = True
#: A work list is captured the time it is seen this often in one arena (the first run also
#: compiles kernels and builds their launches, which must not happen inside a capture).
CAPTURE_AFTER = 2
#: Graphs one arena keeps (a 78-layer model needs one per layer and op where an op's
#: launches name a layer's weights); past this it drops them all.
GRAPHS_PER_ARENA = 1024

MARK, COPY, LAUNCH = 0, 1, 2  # the first field of each work item
_CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
_EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL

_record_lock = threading.Lock()
_record_fn: Any = None  # cuEventRecordWithFlags, once looked up (False: unavailable)


def _external_record() -> Any:
    """``cuEventRecordWithFlags`` of the driver, or None where it is missing."""
    global _record_fn
    if _record_fn is None:
        with _record_lock:
            if _record_fn is None:
                try:
                    fn = ctypes.CDLL("libcuda.so.1").cuEventRecordWithFlags
                    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
                    fn.restype = ctypes.c_int
                    _record_fn = fn
                except (OSError, AttributeError) as exc:
                    log.info("CUDA graphs off: no cuEventRecordWithFlags (%s)", exc)
                    _record_fn = False
    return _record_fn or None


def play(work: list[tuple], events: list[int], stream: int, capturing: bool = False) -> None:
    """Issue a work list on ``stream``; while capturing, marks become event-record nodes."""
    rt = cupy.cuda.runtime
    record = _external_record() if capturing else None
    for item in work:
        kind = item[0]
        if kind == MARK:
            if record is not None:
                err = record(events[item[1]], stream, _EVENT_RECORD_EXTERNAL)
                if err:
                    raise RuntimeError(f"cuEventRecordWithFlags failed: CUDA error {err}")
            else:
                rt.eventRecord(events[item[1]], stream)
        elif kind == COPY:
            _, dst, src, n, direction = item
            rt.memcpyAsync(dst, src, n, direction, stream)
        else:
            item[1](*item[2])


class _Exec:
    """An instantiated graph, destroyed with this object."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            cupy.cuda.runtime.graphExecDestroy(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown or a lost context
            pass


class Graphs:
    """One arena's graphs, by work list, and how often it has seen lists not yet captured."""

    __slots__ = ("execs", "seen")

    def __init__(self) -> None:
        self.execs: dict[tuple, _Exec | None] = {}  # None: capture failed, stay direct
        self.seen: dict[tuple, int] = {}

    def clear(self) -> None:
        self.execs.clear()
        self.seen.clear()

    def run(
        self, work: list[tuple], events: list[int], stream: int, graphable: bool
    ) -> _Exec | None:
        """Issue ``work``: replay its graph, capture it, or launch it directly. Returns the
        graph it launched (None: direct launches), which a caller that knows the list is a
        function of its plan may keep and launch again (``Call.replay``)."""
        if not (ENABLED and graphable):
            play(work, events, stream)
            return None
        key = tuple(work)
        try:
            ex = self.execs[key]
        except KeyError:
            pass
        except TypeError:  # an argument that is no plain value: never captured
            play(work, events, stream)
            return None
        else:
            if ex is None:
                play(work, events, stream)
            else:
                cupy.cuda.runtime.graphLaunch(ex.ptr, stream)
            return ex
        n = self.seen.get(key, 0) + 1
        if n < CAPTURE_AFTER or _external_record() is None:
            if len(self.seen) >= 4 * GRAPHS_PER_ARENA:
                self.seen.clear()
            self.seen[key] = n
            play(work, events, stream)
            return None
        self.seen.pop(key, None)
        if len(self.execs) >= GRAPHS_PER_ARENA:
            self.execs.clear()
        ex = self._capture(work, events, stream)
        self.execs[key] = ex
        if ex is None:
            play(work, events, stream)
        else:
            cupy.cuda.runtime.graphLaunch(ex.ptr, stream)
        return ex

    @staticmethod
    def _capture(work: list[tuple], events: list[int], stream: int) -> _Exec | None:
        rt = cupy.cuda.runtime
        graph = 0
        try:
            rt.streamBeginCapture(stream, _CAPTURE_RELAXED)
            try:
                play(work, events, stream, capturing=True)
            finally:
                graph = rt.streamEndCapture(stream)
            return _Exec(rt.graphInstantiate(graph))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the direct launches
            log.warning("CUDA graph capture failed, this call shape stays direct: %s", exc)
            return None
        finally:
            if graph:
                rt.graphDestroy(graph)
