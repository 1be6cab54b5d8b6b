"""The CuPy backend's per-call plumbing: the context every op's host side runs in
(``kernels/matmul.py``, ``kernels/expert_group.py``, ``kernels/attention_call.py``).

Host time per call is kept near the floor: every buffer of a call (inputs, outputs, scratch, on
the device and pinned on the host) lies in one reusable ``Arena`` with its own timing events,
graphs and plans; a ``Call`` makes the device current (only when it differs), takes the
thread's stream and an arena, lists its device work (the inputs up in one copy, the launches,
the outputs back in one copy, the phases stamped by the copy kernels or framed by events:
``Call``; a stamped call is waited for by polling its output copy's stamp, ``wait``) and
issues it at the end, as a CUDA graph once the arena has seen it before
(``kernels/graphs.py``); a call of a kept plan whose graph is captured launches that graph
without listing its work again (``Replay``), and the decode calls of such a plan (a one-token
routed group, a ragged attention call, an expert group below the pipelined size) are made
without a ``Call`` at all (``rerun``, after ``expert_group.routed_kept`` /
``attention_call.run_kept`` / ``expert_group.group_kept``; each pair compiled in
``server/kept.c`` where that builds, ``server/kept.py``). Large inputs are
copied into pinned memory on several threads (``kernels/pinned.py``), or read by the device
straight from a session's shared-memory segment once CUDA has it registered
(``server/cupy_segments.py``).

A pipelined call (the prefill-sized expert group, ``kernels/expert_group.py``) issues its work
itself, on three streams: the arena's two copy streams (``Arena.streams``: inputs up, outputs
down, one copy engine each) and the call's stream for the kernels, ordered by the arena's
pipeline events (``Arena.pipe_events``); it sets ``Call.spans`` and ``Call.done``, and
``finish`` reads its phases from them (the sum of each phase's busy spans).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import cupy
import cupyx
import numpy as np

from coliworker.kernels import copy
from coliworker.kernels import graphs as cupy_graphs
from coliworker.kernels.copy import copy_launch
from coliworker.kernels.graphs import COPY, LAUNCH, MARK, Graphs
from coliworker.kernels.pinned import align, at, put_host
from coliworker.server import hostmem
from coliworker.server.backend import Phases, Result
from coliworker.server.errors import OutOfDeviceMemory


def oom_error(exc: BaseException, device: int, what: str) -> OutOfDeviceMemory | None:
    """CuPy's device / pinned out-of-memory errors as OutOfDeviceMemory (else None)."""
    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return OutOfDeviceMemory(f"{what}: device {device} is out of memory ({exc})")
    if isinstance(exc, cupy.cuda.runtime.CUDARuntimeError) and "MemoryAllocation" in str(exc):
        return OutOfDeviceMemory(
            f"{what}: device {device} (or pinned host memory) is out of memory ({exc})"
        )
    return None


@contextlib.contextmanager
def oom_guard(device: int, what: str) -> Iterator[None]:
    """Turn CuPy's device / pinned out-of-memory errors into OutOfDeviceMemory."""
    try:
        yield
    except Exception as exc:
        err = oom_error(exc, device, what)
        if err is not None:
            raise err from None
        raise


#: Pinned host memory left free for everything else when a buffer is allocated.
PINNED_HEADROOM = 64 << 20


def pinned(nbytes: int, what: str) -> np.ndarray:
    """A pinned host buffer of ``nbytes`` (uint8), admitted against the host memory the
    worker may use (``hostmem``: the memory cgroup's limit in a container): page-locked
    memory counts against the cgroup like any other, so a call that would pass the limit
    is refused as out of memory instead of the worker being OOM-killed."""
    _, free = hostmem.host_memory()
    if nbytes + PINNED_HEADROOM > free:
        raise OutOfDeviceMemory(
            f"{what}: pinned host memory: needs {nbytes} bytes, {free} available "
            f"(less {PINNED_HEADROOM} kept free; host memory or the memory cgroup's limit)"
        )
    return cupyx.empty_pinned((nbytes,), np.uint8)


# Arenas above this many bytes (device or pinned) are freed after their call rather than kept.
ARENA_KEEP_BYTES = 64 << 20
ARENAS_PER_THREAD = 4  # free arenas a thread keeps per device (one per call it has in flight)
# Outputs of at least this many bytes are handed over in their pinned buffer, not copied.
DETACH_BYTES = 1 << 20
# float32 inputs of at least this many bytes that lie in a session's shared-memory segment go
# to the device straight from it (registered with CUDA on the first such input), not through
# a copy into the pinned buffer.
DIRECT_BYTES = 8 << 20
_NEVER = np.iinfo(np.uint64).max  # a CopyStamp's first between launches (kernels/copy.cu)
_NO_STAMP = (np.uint64(0), np.uint64(0))  # a copy kernel's stamp arguments: none

#: A stamped call (both copies copy kernels: every decode call) is waited for by polling the
#: D2H copy's last stamp in pinned memory, which kernels/copy.cu writes once every output byte
#: is fenced system-wide, rather than by its event, which reaches the host about 4.7 us later
#: (bench/graph_launch.py on an H100: launch + wait 20.0 -> 15.3 us). A poll that finds nothing
#: yields the CPU and the GIL (sched_yield through ctypes, which releases the GIL: other
#: threads run as they would during the event's wait); past POLL_NS the event's wait takes
#: over (a call that failed writes no stamp; its event reports the error).
#: COLIWORKER_POLL=0: the event's wait only.
POLL = os.environ.get("COLIWORKER_POLL", "1") != "0"
POLL_NS = 2_000_000
try:
    _yield: Any = ctypes.CDLL(None).sched_yield
    _yield.argtypes, _yield.restype = (), ctypes.c_int
except (OSError, AttributeError):  # no C library to yield through: the event's wait only
    POLL = False


def wait(a: Arena, stamped: bool, event: int) -> None:
    """Wait for the call in arena ``a`` to finish: for a ``stamped`` call, by polling its D2H
    stamp (``POLL``; ``Arena.take`` clears it), else, and past ``POLL_NS``, by ``event``."""
    if stamped and POLL:
        st = a.stamps
        if st[3]:
            return
        end = time.perf_counter_ns() + POLL_NS
        while True:
            _yield()
            if st[3]:
                return
            if time.perf_counter_ns() > end:
                break
    cupy.cuda.runtime.eventSynchronize(event)


class Arena:
    """Reusable scratch of one call at a time: device bytes, a pinned host twin and four timing
    events. A call takes one from its thread's pool and gives it back once its result is on
    the host, so an issued call owns its buffers until ``result()``; calls beyond the pool's
    size (several in flight) get fresh arenas."""

    __slots__ = ("dev", "dptr", "host", "hmv", "hptr", "events", "eptr", "home", "graphs", "plans",
                 "last", "side", "pipe", "pptr", "stamp_dev", "stamps", "sptr", "h2d_stamp",
                 "d2h_stamp")  # fmt: skip

    def __init__(self, home: list[Arena]) -> None:
        self.dev: Any = None  # cupy.ndarray uint8, set by reserve()
        self.host: Any = None  # pinned np.ndarray uint8, set by reserve()
        # The same bytes as a memoryview, for the per-call struct writes (pack_into into a
        # memoryview takes half the time of one into the ndarray, whose buffer export NumPy
        # builds on every call): set and dropped with host.
        self.hmv: memoryview | None = None
        self.dptr = self.hptr = 0
        self.events = [cupy.cuda.Event() for _ in range(4)]
        self.eptr = [e.ptr for e in self.events]  # raw handles: the runtime calls cost less
        self.home = home
        self.graphs = Graphs()  # the calls' device work, captured (kernels/graphs.py)
        self.plans: dict[tuple, Any] = {}  # the ops' host plans in this arena, by call shape
        # The plan whose constant bytes (job tables, descriptors) the host half holds now, as
        # its last call left them (``Call.kept``); None: not known.
        self.last: Any = None
        self.side: tuple[Any, Any] | None = None  # the copy streams (up, down), once made
        self.pipe: list[Any] = []  # a pipelined call's events, made as needed
        self.pptr: list[int] = []
        # The phase stamps of the call's two copy kernels (kernels/copy.cu): their CopyStamp
        # records on the device, and what they leave in pinned memory, [H2D first, H2D last,
        # D2H first, D2H last] (ns of the GPU's global timer); the copy kernels' stamp
        # arguments, H2D and D2H.
        self.stamp_dev = cupy.asarray(np.array([_NEVER, 0, 0] * 2, np.uint64))
        self.stamps = pinned(32, "call stamps").view(np.uint64)
        self.stamps[:] = 0
        sd, sh = self.stamp_dev.data.ptr, self.stamps.ctypes.data
        self.sptr = sh  # where the stamps lie (server/kept.c reads them there)
        self.h2d_stamp = (np.uint64(sd), np.uint64(sh))
        self.d2h_stamp = (np.uint64(sd + 24), np.uint64(sh + 16))

    def streams(self) -> tuple[Any, Any]:
        """This arena's two copy streams (inputs up, outputs down), made on first use on the
        current device (the call's): non-blocking, like the call's own stream."""
        if self.side is None:
            self.side = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
        return self.side

    def pipe_events(self, n: int) -> list[int]:
        """Handles of ``n`` timing events of this arena (at least; kept for later calls)."""
        while len(self.pipe) < n:
            e = cupy.cuda.Event()
            self.pipe.append(e)
            self.pptr.append(e.ptr)
        return self.pptr

    def take(self) -> Any:
        """This free arena, the top of its thread's pool (``home``), taken for a call: out of the
        pool, and the plan whose constant bytes it held returned and forgotten (the call's
        writes may change any byte; ``keep`` records what it holds again)."""
        self.home.pop()
        self.stamps[3] = 0  # the D2H stamp ``wait`` polls for (the last call has finished)
        last, self.last = self.last, None
        return last

    def keep(self, last: Any, plan: Any) -> bool:
        """``plan`` is from here on the plan whose constant bytes this arena's host half holds;
        whether it held them already, ``last`` being the one it held when the call took it
        (``Call.kept``; the kept input writers ``expert_group._kept_tables`` and
        ``attention_call._inputs``, for a call with or without a ``Call``)."""
        self.last = plan
        return last is plan

    def forget(self) -> None:
        """Drop what holds this arena's addresses: its graphs and plans."""
        self.graphs.clear()
        self.plans.clear()
        self.last = None

    def reserve(self, dev_bytes: int, host_bytes: int) -> None:
        if (self.dev is None or self.dev.nbytes < dev_bytes) or (
            self.host is None or self.host.nbytes < host_bytes
        ):
            self.forget()
        if self.dev is None or self.dev.nbytes < dev_bytes:
            cap = max(align(dev_bytes), 2 * (self.dev.nbytes if self.dev is not None else 0))
            self.dev = None  # this arena's last call is finished: free before the new one
            if cap > ARENA_KEEP_BYTES:
                cap = align(dev_bytes)
            self.dev = cupy.empty((cap,), cupy.uint8)
            self.dptr = self.dev.data.ptr
        if self.host is None or self.host.nbytes < host_bytes:
            cap = max(align(host_bytes), 2 * (self.host.nbytes if self.host is not None else 0))
            self.host = self.hmv = None
            if cap > ARENA_KEEP_BYTES:
                cap = align(host_bytes)
            try:
                self.host = pinned(cap, "call buffer")
            except OutOfDeviceMemory:
                if cap <= align(host_bytes):
                    raise
                self.host = pinned(align(host_bytes), "call buffer")  # no room to grow ahead
            self.hptr = self.host.ctypes.data
            self.hmv = memoryview(self.host)

    def give_back(self) -> None:
        big = (self.dev is not None and self.dev.nbytes > ARENA_KEEP_BYTES) or (
            self.host is not None and self.host.nbytes > ARENA_KEEP_BYTES
        )
        if big:
            self.dev = self.host = self.hmv = None
            self.forget()
        if len(self.home) < ARENAS_PER_THREAD:
            self.home.append(self)


H2D, D2H = 1, 2  # cudaMemcpyKind


class Replay:
    """A plan's device work as its arena last issued it: the graph, and where the output lies.

    An op's plan (kept per arena and call shape: ``kernels/expert_group.py``,
    ``kernels/attention_call.py``, ``kernels/matmul.py``) fixes every address and launch of the
    work its calls list, so the list is a function of the plan: once the list has been
    captured (``kernels/graphs.py``), a later call of the plan writes its inputs and launches
    the kept graph (``Call.replay``) without listing its work again or looking the list up.
    Only the copy switches (``kernels/copy.py``) change the list for one plan; the graph is
    kept with the switches it was captured under and is not replayed under others."""

    __slots__ = ("exec", "out", "stamped", "copies", "view")

    def __init__(self) -> None:
        self.exec: Any = None  # graphs._Exec once captured (held: it lives as long as this)
        self.out: tuple[int, int, tuple[int, ...]] = (0, 0, ())
        self.view: Any = None  # the output in the arena's host half, float32 of its shape
        self.stamped = False
        self.copies: tuple = ()


def _copy_switches() -> tuple:
    return (copy.ENABLED, copy.KERNEL_BYTES)


def replayable(rep: Replay) -> bool:
    """Whether a plan's kept graph may be launched for its next call: captured, graphs on, and
    the copy switches those it was captured under."""
    return rep.exec is not None and cupy_graphs.ENABLED and rep.copies == _copy_switches()


def rerunnable(rep: Replay) -> bool:
    """Whether a plan's next call can be made without a ``Call`` (``rerun``): its graph
    ``replayable`` and its output's view made (by the call that captured the graph)."""
    return rep.view is not None and replayable(rep)


def rerun(a: Arena, rep: Replay, stream: Any, device: int, what: str, lend: bool = False) -> Result:
    """A kept plan's call without a ``Call`` (``CupyBackend``'s decode calls, through
    ``expert_group.routed_kept``, ``attention_call.run_kept`` or ``expert_group.group_kept``, on
    the current device): its inputs written into arena ``a``, which it took from the thread's
    pool, its graph (``rerunnable``) launched on the thread's ``stream`` and waited for, its
    output copied from the plan's view, ``a`` given back; what ``Call.replay`` and
    ``Call.finish`` do for such a call. On an error the GPU is let finish and the arena dropped,
    as ``Call.__exit__`` does.

    ``lend``: the output is the plan's view itself, no copy: the arena's pinned memory, which
    this thread's next call on the device overwrites (``CupyBackend.expert_group``'s ``lend``)."""
    rt = cupy.cuda.runtime
    try:
        rt.graphLaunch(rep.exec.ptr, stream.ptr)
        wait(a, rep.stamped, a.eptr[3])
    except Exception as exc:
        rerun_failed(exc, stream, device, what)
    out = rep.view if lend else rep.view.copy()
    phases = _stamp_phases(a) if rep.stamped else _event_phases(a)
    a.give_back()
    return Result(out, phases)


def rerun_failed(exc: Exception, stream: Any, device: int, what: str) -> NoReturn:
    """Raise what a kept call's failed launch or wait (``exc``) becomes, once the GPU has
    finished what it can (``rerun`` and its compiled twin, ``server/kept.c``)."""
    with contextlib.suppress(Exception):
        stream.synchronize()
    err = oom_error(exc, device, what)
    if err is not None:
        raise err from None
    raise exc


def _stamp_phases(a: Arena) -> Phases:
    """A finished call's phases from its copy kernels' stamps (``Call``'s docstring)."""
    h0, h1, d0, d1 = a.stamps.tolist()
    k = d0 - h1
    return Phases(h1 - h0, k if k > 0 else 0, d1 - d0)


def _event_phases(a: Arena) -> Phases:
    """A finished call's phases from its arena's four events."""
    ms, ev = cupy.cuda.runtime.eventElapsedTime, a.eptr
    return Phases(*(int(ms(ev[i], ev[i + 1]) * 1e6) for i in range(3)))


class Call:
    """One call: the device made current (only when it is not already), the thread's stream
    and an arena. Layout of the arena: [inputs | outputs] mirrored on host and device (the
    inputs go up in one copy, the outputs come back in one), then device-only scratch.

    The device work (``send``, ``launch``, ``receive``) is listed, not issued; ``issue`` (or
    ``finish``) issues the list, as a CUDA graph once the arena has seen it before
    (``kernels/graphs.py``).

    Phases (H2D, kernels, D2H): where both copies are copy kernels (a decode call's few
    hundred KB) the kernels stamp them (``kernels/copy.cu``: the first block's start and the
    last block's end of each copy, by the GPU's global timer) and one event after the D2H
    tells the call it is done; where a copy is on the copy engine the arena's four events
    frame the phases instead (each event record costs a graph node, about 1 us of launch and
    of GPU time)."""

    __slots__ = ("backend", "device", "what", "stream", "pool", "arena", "_prev", "out",
                 "direct", "work", "graphable", "spans", "done", "stamped", "_h2d", "rep",
                 "last", "view")  # fmt: skip

    def __init__(self, backend: Any, device: int, what: str) -> None:
        """``backend``: the CuPy backend (``_thread``: the thread's stream and free arenas of
        the device, and ``_registered`` for inputs in shared-memory segments)."""
        self.backend = backend
        self.device = device
        self.what = what
        self.stream, self.pool = backend._thread(device)
        self.arena: Any = None  # Arena while the call owns one
        self.direct: list[tuple[int, int, int]] = []  # (arena offset, host address, bytes)
        self.work: list[tuple] = []  # the device work not yet issued (kernels/graphs.py)
        self.graphable = True  # False once the work reads a client's segment
        # A pipelined call's phases: (start, end) event handles of each busy span of its
        # H2D, kernel and D2H phases, and the event recorded after all its work; None: the
        # arena's four phase events (module docstring).
        self.spans: tuple[list[tuple[int, int]], ...] | None = None
        self.done = 0
        self.stamped = False  # the phases are the copy kernels' stamps
        self._h2d = -1  # where send's first event lies in work, when its copy is stamped
        self.rep: Replay | None = None  # the plan's graph to keep once issued (``replay``)
        self.last: Any = None  # the arena's last plan when the call took it (``kept``)
        self.view: Any = None  # the output's view in the arena (a replayed plan's), else None

    def __enter__(self) -> Call:
        self._prev = cupy.cuda.runtime.getDevice()
        if self._prev != self.device:
            cupy.cuda.runtime.setDevice(self.device)
        self.stream.__enter__()
        return self

    def __exit__(self, et: type | None, ev: BaseException | None, tb: object) -> None:
        self.stream.__exit__(et, ev, tb)
        if self._prev != self.device:
            cupy.cuda.runtime.setDevice(self._prev)
        if ev is not None:
            if self.arena is not None:  # the GPU may still read it: let it finish, then drop it
                with contextlib.suppress(Exception):
                    self.stream.synchronize()
                    for s in self.arena.side or ():
                        s.synchronize()
                self.arena = None
            err = oom_error(ev, self.device, self.what)
            if err is not None:
                raise err from None

    def take(self) -> Arena:
        """The call's arena (taken from the thread's pool on first use), not yet sized."""
        a = self.arena
        if a is None:
            pool = self.pool
            if pool:
                a = pool[-1]
                self.last = a.take()
            else:
                a = Arena(pool)
                self.last = None
            self.arena = a
        return a

    def kept(self, plan: Any) -> bool:
        """Whether the arena's host half holds ``plan``'s constant bytes (its tables, written
        by its last call, and nothing of another call's written over them since): the op
        skips writing them. Call it right where the op writes them (or skips): from here on
        ``plan`` is the arena's last plan."""
        return self.arena.keep(self.last, plan)

    def reserve(self, dev_bytes: int, host_bytes: int) -> Arena:
        a = self.take()
        a.reserve(dev_bytes, host_bytes)
        return a

    def put(self, off: int, a: np.ndarray, nbytes: int, view: Any = None) -> None:
        """float32 array ``a`` (``nbytes`` bytes) as the inputs' bytes [off, off + nbytes):
        ``send`` reads it where it lies when that is a registered shared-memory segment
        (``CupyBackend.attach_segment``), else it is copied into the arena (``put_host``;
        ``view``: a plan's float32 view of those bytes in the arena's host half, of a's shape,
        which a small ``a`` is assigned to: the same bytes with less work)."""
        if nbytes < DIRECT_BYTES and view is not None:
            view[...] = a
            return
        if nbytes >= DIRECT_BYTES and a.dtype == np.float32 and a.flags.c_contiguous:
            ptr = a.ctypes.data
            if self.backend._registered(ptr, nbytes):
                self.direct.append((off, ptr, nbytes))
                return
        put_host(self.arena.host, off, a, nbytes)

    def send(self, nbytes: int) -> None:
        """The inputs, bytes [0, nbytes) of the arena, host -> device (the ranges ``put``
        left in a registered segment from there), between the H2D phase's events (which
        ``receive`` drops again where both copies are stamped)."""
        a = self.arena
        work = self.work
        work.append((MARK, 0))
        pos = 0
        if self.direct:
            self.graphable = False
        for off, ptr, n in sorted(self.direct):
            if off > pos:
                self._copy(a.dptr + pos, a.hptr + pos, off - pos, H2D)
            work.append((COPY, a.dptr + off, ptr, n, H2D))
            pos = off + n
        if pos < nbytes:
            one = pos == 0  # the whole input in one copy: a kernel stamps it
            stamp = a.h2d_stamp if one else _NO_STAMP
            if self._copy(a.dptr + pos, a.hptr + pos, nbytes - pos, H2D, stamp) and one:
                self._h2d = len(work) - 2
        self.direct = []
        work.append((MARK, 1))

    def _copy(self, dst: int, src: int, n: int, direction: int, stamp: tuple = _NO_STAMP) -> bool:
        """Between the arena's halves: a copy kernel when small and both ends are 16-byte
        aligned (``kernels/copy.py``; ``stamp``: its stamp arguments), else the copy engine
        (the part of the inputs after an array read from a client's segment can start
        anywhere). True: a kernel."""
        aligned = not (dst | src) & 15  # the kernel moves 16-byte lanes
        go = copy_launch(n, self.device) if aligned else None
        if go is None:
            self.work.append((COPY, dst, src, n, direction))
            return False
        self.work.append((LAUNCH, go, (np.uint64(dst), np.uint64(src), *stamp)))
        return True

    def launch(self, go: Any, *args: Any) -> None:
        """Launch ``go(*args)`` (a prepared ``Launch`` or a CuPy kernel) in order."""
        self.work.append((LAUNCH, go, args))

    def launch_all(self, launches: list[tuple]) -> None:
        """``launch`` each ``(go, args)`` of ``launches`` in order: a plan's, made once with
        its arguments (the same objects on every call: the graph's key compares them by
        identity first)."""
        self.work += [(LAUNCH, go, args) for go, args in launches]

    def receive(self, off: int, shape: tuple[int, ...]) -> None:
        """The output float32 ``shape`` at ``off`` device -> host (same offset), then the
        event that ends the call's work. Where the inputs went up in one stamped copy kernel
        and this copy is a kernel too, it is stamped and the H2D phase's events go (the
        phases are the stamps); else the D2H phase's events frame it."""
        a = self.arena
        n = 4 * math.prod(shape)
        self.out = (off, n, shape)
        work = self.work
        i = self._h2d
        stamp = a.d2h_stamp if i >= 0 else _NO_STAMP
        if self._copy(a.hptr + off, a.dptr + off, n, D2H, stamp) and i >= 0:
            del work[i + 2], work[i]  # send's two events around its stamped copy
            self.stamped = True
        else:  # the D2H phase's first event, before its copy
            work.insert(len(work) - 1, (MARK, 2))
        work.append((MARK, 3))

    @staticmethod
    def new_replay() -> Replay:
        """A plan's slot for its kept graph (``Replay``), made with the plan."""
        return Replay()

    def replay(self, rep: Replay) -> bool:
        """Launch the plan's kept graph (``Replay``) when it has one, graphs are on, the copy
        switches are those it was captured under and no input is read from a client's segment:
        True, the call's work is issued (``finish`` waits for it). Else False: the op lists its
        work as usual, and ``issue`` keeps the graph in ``rep`` once there is one."""
        if self.direct or not replayable(rep):
            self.rep = rep
            return False
        cupy.cuda.runtime.graphLaunch(rep.exec.ptr, self.stream.ptr)
        self.out, self.stamped, self.view = rep.out, rep.stamped, rep.view
        return True

    def issue(self) -> None:
        """Issue the listed device work on the call's stream (a graph replay where it can)."""
        work, self.work = self.work, []
        ex = self.arena.graphs.run(work, self.arena.eptr, self.stream.ptr, self.graphable)
        rep = self.rep
        if rep is not None and ex is not None:
            rep.exec, rep.out, rep.stamped = ex, self.out, self.stamped
            rep.copies = _copy_switches()

    def finish(self) -> Result:
        if self.work:
            self.issue()
        a = self.arena
        ev = a.eptr
        rt = cupy.cuda.runtime
        spans = self.spans
        if spans is None:
            wait(a, self.stamped, ev[3])
        else:
            rt.eventSynchronize(self.done)
        off, n, shape = self.out
        view = self.view
        if view is not None:  # a replayed plan's output: below DETACH_BYTES
            out = view.copy()
        elif n >= DETACH_BYTES:
            # The result keeps the pinned buffer (returned to CuPy's pinned pool when it is
            # dropped): no copy into fresh pages, whose first touch costs more than the copy.
            out = at(a.host, off, shape)
            a.host, a.hmv, a.hptr = None, None, 0
            a.forget()
        else:
            view = at(a.host, off, shape)
            out = view.copy()  # arena reused
            rep = self.rep
            if rep is not None and rep.exec is not None:
                rep.view = view  # the plan's (it lives no longer than the arena's host half)
        if self.stamped:
            phases = _stamp_phases(a)
        elif spans is None:
            phases = _event_phases(a)
        else:
            ms = rt.eventElapsedTime
            phases = Phases(*(int(sum(ms(s, e) for s, e in ph) * 1e6) for ph in spans))
        self.arena = None
        a.give_back()
        return Result(out, phases)


class CupyPending:
    """An expert group in flight on its own stream and arena."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._result: Result | None = None

    def result(self) -> Result:
        if self._result is None:
            c = self._call
            prev = cupy.cuda.runtime.getDevice()
            if prev != c.device:
                cupy.cuda.runtime.setDevice(c.device)
            try:
                self._result = c.finish()
            finally:
                if prev != c.device:
                    cupy.cuda.runtime.setDevice(prev)
        return self._result
