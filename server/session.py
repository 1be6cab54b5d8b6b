"""The Session stream: hot calls multiplexed on one bidirectional RPC.

One stream per client. Requests are taken off the stream and dispatched; results go back
as soon as they are ready, each tagged with its request id:

    client ──► handler thread (nothing in flight: reads, runs and answers the call itself)
    client ──► reader thread ──► (idle stream) the handler thread runs it itself
                             └─► (busy stream) a bounded pool of this stream's threads
    handler thread ◄── results ◄── pool            handler thread ──► client

At decode calls come one at a time: the thread that writes the stream then also reads it
and runs the call, with no thread handoff at all. When a request turns out to be queued
already (the client pipelines), a reader thread takes over reading, so a second call that
arrives meanwhile goes to the pool and pipelined calls overlap; after a few calls in a row
that find nothing in flight, reading returns to the handler thread.

Per-request semantics: errors become a ``Status`` result of that request only (mapped like
the unary handlers map them); ragged attention calls on one kv_b run one at a time in
arrival order, because each appends to (or rolls back) resident KV caches. Everything else
may finish out of order. At most ``MAX_IN_FLIGHT`` requests run per stream; beyond that the
reader stops reading, which pushes back on the client through gRPC flow control.

Large arrays arrive as ``chunk`` messages ahead of their call and leave the same way; with
a shared-memory segment attached (``coliworker.wire.shm``) arrays are read from and
written to it. ``attach_shm`` only hands out a ticket; the sealed memfd arrives with it on
the worker's attach socket (``shm_socket.py``), whose thread gives it to the stream
(``attach_segment``); those steps are ``session_shm.py``'s. The segment is unmapped when the
stream ends for any reason.

With a segment attached the client may also open a doorbell channel (``attach_doorbell``,
``server/doorbell.py``): its calls then arrive as frames in segment slots rung through
FIFOs, not on this stream, and run one at a time on the channel's thread through the same
dispatch (same owner, same errors). The channel closes when the stream ends.

A stream with no request, no finished call and no doorbell call for
``--session-idle-timeout`` seconds, and nothing running, is ended with DEADLINE_EXCEEDED
saying so (``idle.py``): an idle client must not hold a thread, a slot of its owner's
``--max-sessions-per-owner`` and a mapped segment forever.

Every call runs through ``Dispatch.run`` (``dispatch.py``), which maps errors to statuses.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from coliworker.server import session_shm
from coliworker.server.dispatch import STATUS_OF
from coliworker.server.doorbell import Doorbell
from coliworker.server.errors import WorkerError
from coliworker.server.idle import IdleWatchdog, Watch, end_stream
from coliworker.server.shm_socket import AttachSocket
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, staging
from coliworker.wire.codec import ArrayIO
from coliworker.wire.shm import Segment, ShmError

log = logging.getLogger(__name__)

#: Requests running or queued per stream before the reader stops reading.
MAX_IN_FLIGHT = 256
#: Pool threads per stream (started on first use).
POOL_THREADS = 4
#: A request that next() returns within this many ns was already queued: the client
#: pipelines, so a reader thread takes over reading.
QUEUED_NS = 30_000
#: Consecutive calls arriving with nothing in flight before the handler thread reads again.
HAND_BACK_AFTER = 4
#: Staged bytes one request may send ahead of its call.
MAX_STAGED_BYTES = 4 << 30

_CALLS = calls.SESSION_KINDS
_END = object()
_WAKE = object()  # re-check who reads (the reader thread handed reading back)


def _chunks(rid: int, views: list[memoryview]) -> Iterator[pb.SessionResponse]:
    """Chunk messages built as they are sent (one chunk's bytes in memory at a time)."""
    for view in views:
        for piece in staging.pieces(view):
            yield pb.SessionResponse(request_id=rid, chunk=piece.tobytes())


@dataclass
class _Job:
    request_id: int
    kind: str
    call: Any
    output: tuple[int, int] | None
    key: Any = None
    source: Any = None  # staging.source of the request's outside arrays, if any
    done: bool = field(default=False)
    t0: float = 0.0  # perf_counter when the request was read (the session metrics' start)
    staged: int = 0  # bytes of chunks staged for it, admitted against the owner


class SessionStream:
    """The state of one Session stream (see the module docstring)."""

    def __init__(self, servicer: Any, owner: str) -> None:
        self.servicer = servicer
        self.owner = owner
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # response lists, _Job, or _END
        self.pool: queue.SimpleQueue = queue.SimpleQueue()  # _Job or None (stop)
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.reading = True
        self.ended = False
        self.busy: dict[Any, collections.deque[_Job]] = {}
        self.slots = threading.Semaphore(MAX_IN_FLIGHT)
        self.staged: dict[int, bytearray] = {}
        # request ids whose chunks were refused (the call is answered with the reason)
        self.overflow: dict[int, str] = {}
        self.segment: Segment | None = None
        self.doorbell: Doorbell | None = None
        self.requests: Iterator[pb.SessionRequest] = iter(())
        # True: the handler thread reads requests itself whenever nothing is in flight;
        # False: a reader thread reads (pipelined calls), until calls come one at a time.
        self.self_reading = True
        # --session-idle-timeout: touched by every request, finished call and doorbell call
        self.watch: Watch | None = None

    def touch(self) -> None:
        """Something happened on this stream (or its doorbell): it is not idle."""
        if self.watch is not None:
            self.watch.touch()

    def running(self) -> bool:
        """A call is running (on the stream or its doorbell channel), or the client is
        passing its segment: not idle however long it takes."""
        bell = self.doorbell
        if self.in_flight > 0 or (bell is not None and bell.busy):
            return True
        attach = self.servicer.sessions.attach_socket
        return attach is not None and attach.waiting(self)

    # -- the handler thread ---------------------------------------------------------------

    def responses(self, request_iterator: Iterator[pb.SessionRequest]) -> Iterator[Any]:
        self.requests = request_iterator
        try:
            while True:
                if self.self_reading:
                    # Read the next request on this thread when nothing runs (no handoff
                    # from a reader thread: one thread switch less per call at decode).
                    try:
                        item = self.out.get_nowait()
                    except queue.Empty:
                        if self.in_flight:
                            item = self.out.get()
                        elif not self._read_here():
                            return
                        else:
                            continue
                else:
                    item = self.out.get()
                if item is _END:
                    return
                if item is _WAKE:
                    continue
                if isinstance(item, _Job):
                    item = self._run(item)
                yield from item
        finally:
            self.close()

    def _read_here(self) -> bool:
        """Read and accept one request on the handler thread (only while nothing is in
        flight); hands reading to the reader thread when requests arrive back to back.
        Returns False when the stream is over."""
        t0 = time.perf_counter_ns()
        try:
            req = next(self.requests)
        except StopIteration:
            req = None
        except Exception as exc:  # the client went away mid-stream
            log.debug("session stream read ended: %s", exc)
            req = None
        if req is None or self.ended:
            with self.lock:
                self.reading = False
            return False
        queued = time.perf_counter_ns() - t0 < QUEUED_NS
        self._accept(req)
        if queued and req.WhichOneof("call") != "chunk":
            # the client pipelines: a reader thread takes the next requests while this
            # thread runs the one just accepted (accepted first: arrival order is kept)
            self.self_reading = False
            threading.Thread(target=self._read, name="session-reader", daemon=True).start()
        return True

    def end(self) -> None:
        """The RPC is over (done callback): wake the handler thread so it cleans up."""
        with self.lock:
            self.reading = False
        self.out.put(_END)

    def close(self) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
            threads, self.threads = self.threads, []
        for _ in threads:
            self.pool.put(None)
        staged, self.staged = self.staged, {}
        for buf in staged.values():  # chunks of calls that never came
            self._unstage(buf)
        attach = self.servicer.sessions.attach_socket
        if attach is not None:
            attach.forget(self)  # a ticket it still holds is void
        if self.doorbell is not None:
            self.doorbell.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    # -- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        idle_calls = 0
        try:
            for req in self.requests:
                if self.ended:
                    break
                kind = req.WhichOneof("call")
                if kind != "chunk":
                    with self.lock:
                        idle_calls = idle_calls + 1 if self.in_flight == 0 else 0
                    if idle_calls >= HAND_BACK_AFTER:
                        # One call at a time again: the handler thread reads from now on.
                        # The call goes out first, then the switch, then a wake-up, so the
                        # handler neither reads before it has the call nor sleeps after it.
                        self._accept(req)
                        self.self_reading = True
                        self.out.put(_WAKE)
                        return
                self._accept(req)
        except Exception as exc:  # the client went away mid-stream
            log.debug("session stream read ended: %s", exc)
        with self.lock:
            self.reading = False
            idle = self.in_flight == 0
        if idle:
            self.out.put(_END)

    def _accept(self, req: pb.SessionRequest) -> None:
        self.touch()
        rid = req.request_id
        kind = req.WhichOneof("call")
        if kind == "chunk":
            if rid in self.overflow:
                return
            data = req.chunk  # each read of a bytes field copies it: read once
            buf = self.staged.get(rid)
            why = None
            if buf is None and len(self.staged) >= MAX_IN_FLIGHT:
                why = f"session.chunk: {len(self.staged)} requests already stage chunks here"
            elif len(buf or b"") + len(data) > MAX_STAGED_BYTES:
                why = f"session.chunk: staged chunks exceed {MAX_STAGED_BYTES} bytes per request"
            else:
                try:  # every staged byte is admitted against the owner's host-memory share
                    self.servicer.owners.stage(self.owner, len(data), "session.chunk")
                except WorkerError as exc:
                    why = exc.message
            if why is not None:
                self._unstage(self.staged.pop(rid, None))
                self.overflow[rid] = why  # the call is answered with the reason
                return
            if buf is None:
                buf = self.staged[rid] = bytearray()
            buf.extend(data)
            return
        t0 = time.perf_counter()
        staged = self.staged.pop(rid, None)
        try:
            self._accept_call(req, rid, kind, staged, t0)
        except BaseException:
            self._unstage(staged)
            raise

    def _unstage(self, staged: bytearray | None) -> None:
        if staged:
            self.servicer.owners.unstage(self.owner, len(staged))

    def _accept_call(
        self, req: pb.SessionRequest, rid: int, kind: str | None, staged: bytearray | None, t0
    ) -> None:
        """Accept one call (its staged chunks, if any, are admitted and given back when the
        call is done or refused)."""
        if staged is not None and kind not in calls.SESSION_KINDS:
            self._unstage(staged)
            staged = None
        if kind == "attach_shm":
            self.out.put([session_shm.ticket(self, rid, req.attach_shm)])
            return
        if kind == "attach_doorbell":
            self.out.put([session_shm.doorbell(self, rid, req.attach_doorbell)])
            return
        if kind is None:
            self._refuse(rid, "session", grpc.StatusCode.INVALID_ARGUMENT, "session: empty", t0)
            return
        call = getattr(req, kind)
        if rid in self.overflow:
            msg = f"{kind}: {self.overflow.pop(rid)}"
            self._unstage(staged)
            self._refuse(rid, kind, grpc.StatusCode.RESOURCE_EXHAUSTED, msg, t0)
            return
        seg = self.segment
        try:
            external = staging.check(call, staged, seg.check if seg is not None else None, kind)
        except (ValueError, ShmError) as exc:
            msg = exc.message if isinstance(exc, ShmError) else str(exc)
            self._unstage(staged)
            self._refuse(rid, kind, grpc.StatusCode.INVALID_ARGUMENT, msg, t0)
            return
        output = None
        if req.HasField("output_shm"):  # checked before the call runs, not after
            output = (req.output_shm.offset, req.output_shm.length)
            try:
                if seg is None:
                    raise ShmError("invalid", "output_shm: no shared-memory segment is attached")
                seg.check(*output, f"{kind}.output_shm")
            except ShmError as exc:
                self._unstage(staged)
                self._refuse(rid, kind, grpc.StatusCode.INVALID_ARGUMENT, exc.message, t0)
                return
        job = _Job(rid, kind, call, output, t0=t0, staged=len(staged) if staged else 0)
        if external:  # the handler's decode reads the bytes straight from chunks / segment
            job.source = staging.source(
                staged,
                seg.read if seg is not None else None,
                kind,
                seg.view if seg is not None else None,
            )
        if kind == "attention_ragged":
            job.key = call.kv_b
        self.slots.acquire()
        with self.lock:
            self.in_flight += 1
            if job.key is not None:
                waiting = self.busy.get(job.key)
                if waiting is not None:
                    waiting.append(job)  # runs when the earlier call on this kv_b is done
                    return
                self.busy[job.key] = collections.deque()
            inline = self.in_flight == 1
        self._dispatch(job, inline)

    def _dispatch(self, job: _Job, inline: bool) -> None:
        if inline:
            self.out.put(job)
            return
        with self.lock:
            if not self.threads and not self.ended:
                for i in range(POOL_THREADS):
                    t = threading.Thread(target=self._work, name=f"session-pool-{i}", daemon=True)
                    t.start()
                    self.threads.append(t)
        self.pool.put(job)

    def _work(self) -> None:
        while True:
            job = self.pool.get()
            if job is None:
                return
            self.out.put(self._run(job))

    # -- running one request --------------------------------------------------------------

    def _run(self, job: _Job) -> Iterable[pb.SessionResponse]:
        try:
            out = self._execute(job)
        finally:
            self._finish(job)
        code = grpc.StatusCode.OK
        if isinstance(out, list) and out[-1].WhichOneof("result") == "error":
            code = STATUS_OF.get(out[-1].error.code, grpc.StatusCode.UNKNOWN)
        self.servicer.hooks.record_session_request(
            job.kind, code, time.perf_counter() - job.t0, "grpc"
        )
        return out

    def _refuse(self, rid: int, kind: str, code: grpc.StatusCode, message: str, t0: float) -> None:
        """Answer a request refused before it runs, and count it like the ones that run."""
        self.out.put([self._error(rid, code, message)])
        self.servicer.hooks.record_session_request(kind, code, time.perf_counter() - t0, "grpc")

    def _execute(self, job: _Job, chunks: bool = True) -> Iterable[pb.SessionResponse]:
        side: list = []  # result arrays the handler leaves for _place
        out = self.servicer.dispatch.run(
            calls.BY_KIND[job.kind], job.call, self.owner, ArrayIO(job.source, side)
        )
        if not out.ok:
            return [self._error(job.request_id, out.code, out.message)]
        try:
            return self._place(out.response, job, side, chunks)
        except ShmError as exc:  # the segment went away while the stream was ending
            return [self._error(job.request_id, grpc.StatusCode.CANCELLED, exc.message)]

    def _place(
        self, body: Any, job: _Job, side: list, chunks: bool = True
    ) -> Iterable[pb.SessionResponse]:
        """Move result arrays into the offered shared memory, or into chunks when large
        (``chunks``; else inline), straight from the NumPy results ``codec.encode`` left in
        ``side`` (their bytes never enter a protobuf message, except small ones inline)."""
        seg = self.segment
        off, room = job.output if job.output is not None and seg is not None else (0, 0)
        views: list[memoryview] = []
        staged = 0
        for a in staging.iter_arrays(body):
            inline = not a.HasField("staged")
            if inline:
                view = memoryview(a.data)
            else:  # an index into side
                view = memoryview(side[a.staged.offset]).cast("B")
                a.ClearField("staged")
            n = len(view)
            if n and n <= room:
                seg.write(off, view)  # type: ignore[union-attr]
                a.ClearField("data")
                a.shm.offset, a.shm.length = off, n
                step = (n + 63) // 64 * 64
                off += step
                room -= min(room, step)
            elif n > staging.STAGE_ABOVE and chunks:
                views.append(view)
                a.ClearField("data")
                a.staged.offset, a.staged.length = staged, n
                staged += n
            elif not inline:
                a.data = view.tobytes()
        rid = job.request_id
        resp = pb.SessionResponse(request_id=rid, **{job.kind: body})
        if not views:
            return [resp]
        return itertools.chain(_chunks(rid, views), (resp,))

    def _finish(self, job: _Job) -> None:
        self.touch()
        if job.staged:
            self.servicer.owners.unstage(self.owner, job.staged)
        nxt = None
        with self.lock:
            self.in_flight -= 1
            if job.key is not None:
                waiting = self.busy[job.key]
                if waiting:
                    nxt = waiting.popleft()
                else:
                    del self.busy[job.key]
            end = not self.reading and self.in_flight == 0
        self.slots.release()
        if nxt is not None:
            self._dispatch(nxt, False)
        if end:
            self.out.put(_END)

    @staticmethod
    def _error(rid: int, code: grpc.StatusCode, message: str) -> pb.SessionResponse:
        return session_shm.error(rid, code, message)

    def attach_segment(self, seg: Segment) -> tuple[int, str]:
        """The attach socket's thread hands this stream its segment (``session_shm.py``)."""
        return session_shm.attach_segment(self, seg)


class SessionManager:
    """Serves Session streams for one servicer; tracks the live ones."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self._lock = threading.Lock()
        self._streams: set[SessionStream] = set()
        # where clients pass their segments (server/shm_socket.py; the app makes it)
        self.attach_socket: AttachSocket | None = None
        config = getattr(servicer, "config", None)
        self.idle = IdleWatchdog(getattr(config, "session_idle_timeout", 0.0))

    def serve(self, request_iterator, context: grpc.ServicerContext) -> Iterator[Any]:
        stream = SessionStream(self.servicer, self.servicer.owner(context))
        with self._lock:
            self._streams.add(stream)
        timeout = self.idle.timeout
        why = (
            f"session: no call for {timeout:g} s (--session-idle-timeout {timeout:g}); the "
            f"worker ended the stream and released its segment, open a new session"
        )
        stream.watch = self.idle.watch(
            lambda: end_stream(context, grpc.StatusCode.DEADLINE_EXCEEDED, why),
            "Session stream",
            busy=stream.running,
        )

        def done() -> None:
            if stream.watch is not None:
                stream.watch.close()
            stream.end()
            stream.close()
            with self._lock:
                self._streams.discard(stream)

        context.add_callback(done)
        return stream.responses(request_iterator)

    def streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def attached_segments(self) -> list[str]:
        """Names of the shared-memory segments mapped now (for tests and diagnostics)."""
        with self._lock:
            return [s.segment.name for s in self._streams if s.segment is not None]

    def doorbell_threads(self) -> list[threading.Thread]:
        """The doorbell channel threads still running (for tests and diagnostics)."""
        with self._lock:
            bells = [s.doorbell for s in self._streams if s.doorbell is not None]
        return [b.thread for b in bells if b.thread.is_alive()]


__all__ = ["MAX_IN_FLIGHT", "SessionManager", "SessionStream"]
