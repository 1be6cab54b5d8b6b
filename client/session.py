"""``Session``: the hot calls on one bidirectional stream, several in flight.

    with WorkerClient(addr) as w, w.session(shm=True) as s:
        fut = s.expert_group_routed(experts, x, routes, weights)   # returns at once
        att = s.attention_ragged(kv_b, o_proj, q, sequences=..., ...)
        y, a = fut.result(), att.result()
        y2 = s.expert_group_routed_sync(experts, x2, routes, weights)   # submit + wait

Each call gets a request id; a background reader thread matches responses to futures, so
any number of calls (up to the worker's window) overlap on the wire and in the worker. An
error fails only its own future (``WorkerError`` subclasses, as the unary calls raise);
the stream stays usable. Ragged attention calls on one kv_b run in the order submitted.

``shm=True`` (same host only) attaches a shared-memory segment (a sealed memfd passed to
the worker over its attach socket, ``coliworker.wire.shm``): activations in and out travel
through it and the stream carries only small control messages. Arrays over 1 MiB
that do not go through shared memory travel as chunks.

``doorbell=True`` (with ``shm=True``) takes the calls off gRPC altogether: each goes into
a slot of the segment and rings a FIFO, and the worker answers the same way
(``client/doorbell.py``); the stream only attaches and keeps the channel alive. A call
waits in the thread that asks for its result, with no reader thread in between. The
channel runs calls one at a time in submission order (up to ``doorbell.SLOTS`` queued);
open several sessions for parallel channels. Arrays must fit the segment: a call that
does not raises ResourceExhausted.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from coliworker.client import doorbell as bell
from coliworker.client import errors
from coliworker.client.session_calls import (
    Decoder,
    SessionCalls,
    SessionFuture,
    WaitingFuture,
    raw,
)
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import bell as bell_slots
from coliworker.wire import calls, frames, staging
from coliworker.wire.shm import (
    PASS_TIMEOUT_S,
    Allocator,
    Segment,
    ShmError,
    pass_fd,
    segment_bytes,
)

log = logging.getLogger(__name__)

_STATUS_OF = {c.value[0]: c for c in grpc.StatusCode}
#: Turns a response body into the call's value; gets the future to fill backend_ns/lengths.


def _error(status: pb.Status) -> errors.WorkerError:
    code = _STATUS_OF.get(status.code, grpc.StatusCode.UNKNOWN)
    return errors.from_status(code, status.message)


def _chunks(rid: int, pieces: list[memoryview]) -> Iterator[pb.SessionRequest]:
    """Chunk messages built as the stream sends them (one chunk's copy alive at a time)."""
    for p in pieces:
        yield pb.SessionRequest(request_id=rid, chunk=p.tobytes())


class Session(SessionCalls):
    """One Session stream of a ``WorkerClient`` (use ``WorkerClient.session()``).

    ``shm``: attach a shared-memory segment of ``shm_bytes`` (same host only; raises the
    worker's error, e.g. FailedPrecondition on another host). ``doorbell``: also open a
    doorbell channel and send every call through it (needs ``shm``); ``spin_us`` /
    ``worker_spin_us``: how long a thread waiting for a result / the worker's channel
    thread waiting for the next call polls before it sleeps (0: sleep at once; polling
    saves ~20 us per wake-up and costs that thread's core meanwhile). ``timeout``: default
    wait of ``result()`` in the sync helpers (the client's timeout when None).
    """

    def __init__(
        self,
        client: Any,
        *,
        shm: bool = False,
        shm_bytes: int = 256 << 20,
        doorbell: bool = False,
        spin_us: int = bell.SPIN_US,
        worker_spin_us: int = bell.WORKER_SPIN_US,
        timeout: float | None = None,
    ) -> None:
        if doorbell and not shm:
            raise ValueError("doorbell: expected shm=True (the channel lives in the segment)")
        self._client = client
        self.wire_dtype = client.wire_dtype
        self.timeout = client.timeout if timeout is None else timeout
        self._send: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, tuple[SessionFuture, Decoder]] = {}
        self._chunks: dict[int, bytearray] = {}
        self._ids = itertools.count(1)
        self._tls = threading.local()  # arrays encoded for the call being built
        self._lock = threading.Lock()
        self._broken: errors.WorkerError | None = None
        self._closed = False
        self.segment: Segment | None = None
        self._alloc: Allocator | None = None
        self._bell: bell.Channel | None = None
        self._call = client._stub.Session(self._requests())
        self._reader = threading.Thread(target=self._read, name="session-reader", daemon=True)
        self._reader.start()
        if shm:
            try:
                self._attach(shm_bytes)
                if doorbell:
                    self._attach_doorbell(spin_us, worker_spin_us)
            except BaseException:
                self.close()
                raise

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the stream (in-flight calls complete first) and release shared memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._bell is not None:
            self._bell.close(timeout)  # pending calls finish first
        self._send.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(1.0)
        if self.segment is not None:
            self.segment.close()

    def _attach(self, size: int) -> None:
        """Attach a new segment of ``size`` bytes (``coliworker.wire.shm``): the ticket
        first, so that a worker on another host costs no memory here."""
        got = self._ticket(segment_bytes(size))
        if not os.path.exists(got.socket):
            raise errors.FailedPrecondition(
                f"attach_shm: the worker's attach socket {got.socket} is not on this host (is "
                f"the worker on another host?)"
            )
        try:
            seg = Segment.create(size)  # sealed and allocated
        except ShmError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            if exc.kind != "exhausted":
                code = grpc.StatusCode.FAILED_PRECONDITION
            raise errors.from_status(code, exc.message) from None
        try:
            self._pass(seg, got)
        except BaseException:
            seg.close()
            raise
        self.segment, self._alloc = seg, Allocator(seg.size)

    def _attach_segment(self, seg: Segment) -> None:
        """Attach ``seg`` (made by the caller): a ticket, then the memfd."""
        self._pass(seg, self._ticket(seg.size))

    def _ticket(self, size: int) -> pb.ShmTicket:
        """Step 2 of ``coliworker.wire.shm``: a ticket of this stream for ``size`` bytes."""
        got = self._submit("attach_shm", pb.ShmAttach(size=size), None).result(self.timeout)
        if not isinstance(got, pb.ShmTicket):
            raise errors.InternalError(f"attach_shm: expected a ShmTicket, got {got!r}")
        return got

    def _pass(self, seg: Segment, got: pb.ShmTicket) -> None:
        """Step 3: the memfd and the ticket over the worker's attach socket; raises the
        worker's error."""
        path = got.socket
        try:
            code, message = pass_fd(path, got.ticket, seg.fd, self.timeout or PASS_TIMEOUT_S)
        except (FileNotFoundError, ConnectionRefusedError):
            raise errors.FailedPrecondition(
                f"attach_shm: the worker's attach socket {path} is not on this host (is the "
                f"worker on another host?)"
            ) from None
        except PermissionError as exc:
            raise errors.PermissionDenied(f"attach_shm: cannot reach {path}: {exc}") from None
        except OSError as exc:
            raise errors.Unavailable(f"attach_shm: passing the segment to {path}: {exc}") from None
        if code:
            raise errors.from_status(_STATUS_OF.get(code, grpc.StatusCode.UNKNOWN), message)

    def _attach_doorbell(self, spin_us: int, worker_spin_us: int) -> None:
        assert self._alloc is not None and self.segment is not None  # _attach ran
        size = 2 * bell.SLOTS * bell.SLOT_BYTES
        off = self._alloc.alloc(size)
        if off is None:
            raise errors.ResourceExhausted(
                f"doorbell: the segment has no room for {size} bytes of slots"
            )
        ch = bell.Channel.create(self.segment, off, spin_us=spin_us, worker_spin_us=worker_spin_us)
        try:
            self._submit("attach_doorbell", ch.attach_message(), None).result(self.timeout)
            ch.connect()
        except BaseException:
            ch.close(0)
            self._alloc.free(off, size)
            raise
        ch.on_closed = self._await_stream_end
        self._bell = ch

    #: How long a doorbell call that finds the worker's end closed waits for the stream's last
    #: status, whose reason (an idle timeout, a drain) it then reports.
    STREAM_END_WAIT = 2.0

    def _await_stream_end(self) -> None:
        """The worker closed the doorbell: it ends the stream too, with the reason. Wait
        (bounded) for the reader to see that end; the reader then fails the channel with it."""
        if threading.current_thread() is not self._reader:
            self._reader.join(self.STREAM_END_WAIT)

    @property
    def transport(self) -> str:
        """ "shm" with a doorbell channel, else "grpc" (the Session stream)."""
        return "shm" if self._bell is not None else "grpc"

    @property
    def shm(self) -> bool:
        """Whether activations travel through shared memory."""
        return self.segment is not None

    @property
    def doorbell(self) -> bool:
        """Whether calls travel through a doorbell channel instead of the stream."""
        return self._bell is not None

    # -- the stream -----------------------------------------------------------------------

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._send.get()
            if item is None:
                return
            yield from item

    def _read(self) -> None:
        try:
            for resp in self._call:
                self._receive(resp)
            err: errors.WorkerError = errors.Unavailable("session stream ended")
        except grpc.RpcError as exc:
            err = errors.from_rpc_error(exc)
        with self._lock:
            self._broken = err
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            self._free_regions(fut)
            fut._set(error=err)
        if self._bell is not None:  # the worker closes its end too; do not wait for that
            self._bell.fail(errors.Unavailable(f"doorbell: the session stream ended ({err})"))

    def _receive(self, resp: pb.SessionResponse) -> None:
        rid = resp.request_id
        kind = resp.WhichOneof("result")
        if kind == "chunk":
            buf = self._chunks.get(rid)
            if buf is None:
                buf = self._chunks[rid] = bytearray()
            buf.extend(resp.chunk)
            return
        with self._lock:
            entry = self._pending.pop(rid, None)
        staged = self._chunks.pop(rid, None)
        if entry is None:
            return  # nobody waits for it (never happens unless the worker misbehaves)
        fut, decode = entry
        try:
            value = self._result(resp, kind, staged, decode, fut)
        except BaseException as exc:
            self._free_regions(fut)
            fut._set(error=exc)
            return
        self._free_regions(fut)
        fut._set(value)

    def _result(
        self,
        resp: pb.SessionResponse,
        kind: str | None,
        staged: bytearray | None,
        decode: Decoder,
        fut: SessionFuture,
    ) -> Any:
        """The decoded value of a response, or its error raised."""
        if kind == "error":
            raise _error(resp.error)
        if kind is None:
            raise errors.InternalError(f"session request {resp.request_id}: empty response")
        body = getattr(resp, kind)
        seg = self.segment
        if staging.check(body, staged, seg.check if seg is not None else None, "result"):
            # decode reads the bytes straight from the chunks / one copy out of the segment
            return decode(
                body, fut, staging.source(staged, seg.read_array if seg else None, "result")
            )
        return decode(body, fut, None)

    def _free_regions(self, fut: SessionFuture) -> None:
        if self._alloc is not None:
            for off, n in fut._regions:
                self._alloc.free(off, n)
        fut._regions = []

    def _submit(
        self,
        kind: str,
        body: Any,
        decode: Decoder | None,
        out_bytes: int = 0,
        side: list[np.ndarray] | None = None,
    ) -> SessionFuture:
        side = self._take_side() if side is None else side
        if self._bell is not None and kind != "attach_doorbell":
            return self._submit_bell(kind, body, decode or raw, out_bytes, side)
        rid = next(self._ids)
        fut = SessionFuture(rid)
        req = pb.SessionRequest(request_id=rid, **{kind: body})
        pieces = self._place(getattr(req, kind), side, fut) if side else []
        if self._alloc is not None and out_bytes:
            off = self._alloc.alloc(out_bytes)
            if off is not None:
                fut._regions.append((off, out_bytes))
                req.output_shm.offset, req.output_shm.length = off, out_bytes
        msgs: Iterable[pb.SessionRequest] = (
            itertools.chain(_chunks(rid, pieces), (req,)) if pieces else (req,)
        )
        with self._lock:
            if self._closed or self._broken is not None:
                err = self._broken
                if self._closed or err is None:
                    err = errors.Cancelled("session is closed")
                self._free_regions(fut)
                raise err
            self._pending[rid] = (fut, decode or raw)
        self._send.put(msgs)
        return fut

    def _submit_bell(
        self,
        kind: str,
        body: Any,
        decode: Decoder,
        out_bytes: int,
        side: list[np.ndarray],
    ) -> SessionFuture:
        """A call through the doorbell channel: every array in the segment, the message in
        a slot (``client/doorbell.py``)."""
        ch, alloc, seg = self._bell, self._alloc, self.segment
        assert ch is not None and alloc is not None and seg is not None
        rid = next(self._ids)
        fut = WaitingFuture(rid, ch)
        call = calls.BY_KIND[kind]
        try:
            if self._closed:
                raise errors.Cancelled("session is closed")
            for a in staging.iter_arrays(body):
                if not a.HasField("staged") or a.data:
                    continue
                view = memoryview(side[a.staged.offset]).cast("B")
                off = alloc.alloc(len(view))
                if off is None:
                    raise self._no_room(kind, len(view))
                fut._regions.append((off, len(view)))
                seg.write(off, view)
                a.ClearField("staged")
                a.shm.offset, a.shm.length = off, len(view)
            out_off = 0
            if out_bytes:
                out_off = alloc.alloc(out_bytes)
                if out_off is None:
                    raise self._no_room(kind, out_bytes)
                fut._regions.append((out_off, out_bytes))
            payload = body.SerializeToString()
            msg = bell_slots.PREFIX.pack(out_off, out_bytes) + b"".join(
                frames.frame(frames.CALL, call.method, rid, payload)
            )

            def done(data: bytes | None, err: BaseException | None) -> None:
                value = None
                if err is None:
                    try:
                        value = self._bell_result(data, call, rid, decode, fut)  # type: ignore[arg-type]
                    except BaseException as exc:
                        err = exc
                self._free_regions(fut)
                fut._set(value, err)

            ch.submit(msg, fut, done)
        except BaseException:
            self._free_regions(fut)
            raise
        return fut

    def _bell_result(
        self, data: bytes, call: Any, rid: int, decode: Decoder, fut: SessionFuture
    ) -> Any:
        """The value of a REPLY frame read from a response slot, or its error raised."""
        head = frames.parse(data)
        if head.request_id != rid and head.request_id:
            raise errors.InternalError(f"doorbell: answer for request {head.request_id}, not {rid}")
        body = memoryview(data)[frames.HEADER_BYTES : frames.HEADER_BYTES + head.body_bytes]
        if head.status:
            raise errors.from_status(
                _STATUS_OF.get(head.status, grpc.StatusCode.UNKNOWN),
                bytes(body).decode("utf-8", "replace"),
            )
        resp = call.response.FromString(body)
        staged = memoryview(data)[frames.HEADER_BYTES + head.body_bytes :]
        seg = self.segment
        if staging.check(resp, staged, seg.check if seg is not None else None, "result"):
            return decode(
                resp, fut, staging.source(staged, seg.read_array if seg else None, "result")
            )
        return decode(resp, fut, None)

    def _no_room(self, kind: str, n: int) -> errors.ResourceExhausted:
        size = self.segment.size if self.segment is not None else 0
        return errors.ResourceExhausted(
            f"{kind}: no room for {n} bytes in the shared-memory segment ({size} bytes, "
            f"shm_bytes); doorbell calls keep every array in it"
        )

    def _place(self, body: Any, side: list[np.ndarray], fut: SessionFuture) -> list[memoryview]:
        """Give each encoded array its bytes: shared memory when attached and room is left,
        else inline when small, else chunks. The bytes are copied once, straight from the
        NumPy array (a large array never enters a protobuf message)."""
        pieces: list[memoryview] = []
        staged = 0
        for a in staging.iter_arrays(body):
            if not a.HasField("staged") or a.data:
                continue
            raw = side[a.staged.offset]
            n = raw.nbytes
            view = memoryview(raw).cast("B")
            if self._alloc is not None:
                off = self._alloc.alloc(n)
                if off is not None:
                    fut._regions.append((off, n))
                    self.segment.write(off, view)  # type: ignore[union-attr]
                    a.ClearField("staged")
                    a.shm.offset, a.shm.length = off, n
                    continue
            if n > staging.STAGE_ABOVE:
                pieces += staging.pieces(view)
                a.staged.offset, a.staged.length = staged, n
                staged += n
            else:
                a.ClearField("staged")
                a.data = view.tobytes()
        return pieces


TRANSPORTS = ("auto", "grpc", "socket", "shm")


def open_session(
    client: Any,
    transport: str | None = None,
    *,
    shm: bool | None = None,
    shm_bytes: int = 256 << 20,
    doorbell: bool | None = None,
    **options: Any,
) -> Any:
    """The session ``WorkerClient.session`` describes: the one place a transport is chosen
    (the recovering session reopens through it too)."""
    if transport is None:
        transport = "grpc" if shm is not None or doorbell is not None else "auto"
    if transport not in TRANSPORTS:
        raise ValueError(
            f"session.transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}"
        )
    if transport == "grpc":
        return Session(
            client, shm=bool(shm), shm_bytes=shm_bytes, doorbell=bool(doorbell), **options
        )
    if transport == "shm":
        return Session(client, shm=True, shm_bytes=shm_bytes, doorbell=True, **options)
    from coliworker.client.socket_session import SocketSession

    socket_options = {k: v for k, v in options.items() if k in ("spin_us", "timeout", "address")}
    if transport == "socket":
        return SocketSession(client, **socket_options)
    try:
        return Session(client, shm=True, shm_bytes=shm_bytes, doorbell=True, **options)
    except (errors.FailedPrecondition, errors.PermissionDenied, errors.InvalidArgument, OSError):
        pass  # another host (or a segment this worker may not open)
    except errors.ResourceExhausted as exc:  # no room for the segment (a tight memory cgroup)
        log.info("session: no shared memory (%s); the socket data plane carries the calls", exc)
    try:
        return SocketSession(client, **socket_options)
    except errors.Unavailable:
        pass  # no data plane reachable (e.g. behind an L7 proxy)
    return Session(client, **options)


__all__ = ["TRANSPORTS", "Session", "open_session"]
