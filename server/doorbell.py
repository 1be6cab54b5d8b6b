"""The worker end of a doorbell channel (``coliworker.client.doorbell`` has the design,
``coliworker.wire.bell`` the slot layout: data-plane frames in shared memory).

One thread per channel: it waits on the ``request`` FIFO, reads each CALL frame from its
slot in the session's segment, runs it through the one dispatch (same validation, same
errors, the stream's owner), writes the REPLY frame into the matching response slot and
rings ``response``. It exits when the client's end closes (end of file),
when the client stops reading (EPIPE), or when the Session stream ends (``close``).

Before opening anything the worker checks, on the open descriptors (no race between check
and use), that the directory is a real directory (not a link) and the FIFOs are FIFOs, all
owned by the worker's own uid with no group/other permission bits; anything else is
refused with PERMISSION_DENIED (a missing directory: FAILED_PRECONDITION, as for a segment
on another host).
"""

from __future__ import annotations

import logging
import os
import re
import select
import stat
import threading
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coliworker.server.fastpath import FastCalls, FastReply
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import bell, calls, frames, staging
from coliworker.wire.bell import REQUEST, RESPONSE
from coliworker.wire.codec import ArrayIO
from coliworker.wire.shm import ALIGN, Segment, ShmError, shm_dir

log = logging.getLogger(__name__)

MAX_SLOTS = 64
MAX_SPIN_US = 10_000
MIN_SLOT_BYTES, MAX_SLOT_BYTES = 4096, 16 << 20
_DIR = re.compile(r"^coliworker-\d+-[0-9a-f]{16}\.bell$")
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _uid() -> int:
    """The uid every channel file must belong to: the worker's own."""
    return os.geteuid()


def _check_owner(fd: int, what: str, kind: str) -> None:
    st = os.fstat(fd)
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISFIFO
    if not is_kind(st.st_mode):
        raise ShmError("permission", f"attach_doorbell: {what} is not a {kind}")
    if st.st_uid != _uid():
        raise ShmError(
            "permission",
            f"attach_doorbell: {what} is owned by uid {st.st_uid}, expected the worker's "
            f"uid {_uid()}",
        )
    if st.st_mode & 0o077:
        want = "0700" if kind == "directory" else "0600"
        raise ShmError(
            "permission",
            f"attach_doorbell: {what} has mode {stat.S_IMODE(st.st_mode):04o}, expected "
            f"{want} (no group/other access)",
        )


def _open_fifos(name: str, directory: str | None = None) -> tuple[int, int]:
    """(read end of request, write end of response), after the ownership checks."""
    if not _DIR.match(name):
        raise ShmError(
            "invalid",
            f"attach_doorbell.directory: expected coliworker-<pid>-<16 hex>.bell, got {name!r}",
        )
    path = os.path.join(directory or shm_dir(), name)
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShmError(
            "not_found",
            f"attach_doorbell.directory: {path} does not exist here (is the worker on another "
            f"host?)",
        ) from None
    except OSError as exc:  # ELOOP / ENOTDIR: a link or a file
        raise ShmError(
            "permission", f"attach_doorbell.directory: cannot open {path}: {exc}"
        ) from None
    fds: list[int] = []
    try:
        _check_owner(dfd, path, "directory")
        for fifo, flags in ((REQUEST, os.O_RDONLY), (RESPONSE, os.O_WRONLY)):
            what = os.path.join(path, fifo)
            try:
                # Non-blocking: opening must not wait for the peer (the client already
                # holds the read end of "response"; ENXIO says it does not).
                fd = os.open(fifo, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                raise ShmError("not_found", f"attach_doorbell: {what} does not exist") from None
            except OSError as exc:
                raise ShmError(
                    "permission", f"attach_doorbell: cannot open {what}: {exc}"
                ) from None
            fds.append(fd)
            _check_owner(fd, what, "FIFO")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(dfd)
    return fds[0], fds[1]


def check_slots(seg: Segment, msg: pb.DoorbellAttach) -> None:
    """ShmError("invalid") naming the field when the slot area is malformed."""
    if not 1 <= msg.slots <= MAX_SLOTS:
        raise ShmError(
            "invalid", f"attach_doorbell.slots: expected 1..{MAX_SLOTS}, got {msg.slots}"
        )
    b = msg.slot_bytes
    if not MIN_SLOT_BYTES <= b <= MAX_SLOT_BYTES or b % 64:
        raise ShmError(
            "invalid",
            f"attach_doorbell.slot_bytes: expected a multiple of 64 in "
            f"{MIN_SLOT_BYTES}..{MAX_SLOT_BYTES}, got {b}",
        )
    if msg.worker_spin_us > MAX_SPIN_US:
        raise ShmError(
            "invalid",
            f"attach_doorbell.worker_spin_us: expected 0..{MAX_SPIN_US}, got {msg.worker_spin_us}",
        )
    seg.check(msg.slots_offset, 2 * msg.slots * b, "attach_doorbell.slots_offset")


class Doorbell:
    """The worker end of one channel; ``stream`` is its Session stream (owner, servicer)."""

    def __init__(self, stream: Any, seg: Segment, msg: pb.DoorbellAttach) -> None:
        check_slots(seg, msg)
        self.stream, self.segment = stream, seg
        self.offset, self.slots, self.slot_bytes = msg.slots_offset, msg.slots, msg.slot_bytes
        self._req, self._resp = _open_fifos(msg.directory)
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._closed = False
        self.calls = 0
        self.fast = stream.servicer.fastcalls  # the decode calls' compiled path, or None
        self.busy = False  # a call is running (the session's idle timeout waits for it)
        self.spin_ns = msg.worker_spin_us * 1000
        self.thread = threading.Thread(
            target=self._serve, name=f"doorbell-{msg.directory}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop the thread (the Session stream ended). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.write(self._wake_w, b"\0")
        if not self.thread.is_alive() and self.thread.ident is None:
            self._release()  # never started

    def _release(self) -> None:
        for fd in (self._req, self._resp, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the channel thread ---------------------------------------------------------------

    def _serve(self) -> None:
        poll = select.poll()
        poll.register(self._req, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        slot = 0
        rang = False  # a first ring came: the client's end is open
        try:
            while not self._closed:
                rings = self._spin() if rang and self.spin_ns else None
                if rings is None:
                    # Poll before reading: until the client opens its end there is no
                    # writer, and a read would return end of file while poll reports
                    # nothing (a FIFO hangs up only after a writer came and went), so this
                    # waits for the first ring.
                    events = poll.poll()
                    if any(fd == self._wake_r for fd, _ in events):
                        return
                    try:
                        rings = os.read(self._req, self.slots)
                    except BlockingIOError:
                        continue
                if not rings:
                    return  # end of file: the client closed the channel or died
                rang = True
                for ring in rings:
                    if self._closed:
                        return
                    if ring != slot:
                        log.warning("doorbell %s: ring for slot %d, expected %d", self, ring, slot)
                        return
                    self.busy = True
                    try:
                        data = self._answer(slot)
                    finally:
                        self.busy = False
                        self.stream.touch()  # a call: the session is not idle
                    if self._closed:
                        return  # the stream ended during the call: nobody to answer
                    off = self.offset + (self.slots + slot) * self.slot_bytes
                    self.segment.write(off, bell.PREFIX.pack(0, 0) + data)
                    os.write(self._resp, bytes((slot,)))
                    slot = (slot + 1) % self.slots
        except (OSError, ShmError) as exc:  # EPIPE (client gone) or the segment detached
            log.debug("doorbell channel ended: %s", exc)
        finally:
            with self._lock:
                self._closed = True
                self._release()

    def _spin(self) -> bytes | None:
        """Poll for the next ring without sleeping for ``spin_ns`` (a sleeping thread takes
        ~20 us to wake); None when none came. Each read releases the GIL."""
        end = time.perf_counter_ns() + self.spin_ns
        while not self._closed:
            try:
                return os.read(self._req, self.slots)
            except BlockingIOError:
                if time.perf_counter_ns() >= end:
                    return None
        return None

    def _answer(self, slot: int) -> bytes:
        """Run the CALL frame in request slot ``slot``; the bytes of its REPLY frame."""
        t0 = time.perf_counter()
        seg = self.segment
        off = self.offset + slot * self.slot_bytes
        room = bell.room(self.slot_bytes)
        lead = seg.read(off, bell.FRAME_AT + frames.HEADER_BYTES, "doorbell")  # prefix + header
        out_off, out_len = bell.PREFIX.unpack_from(lead)
        method = rid = 0
        kind = "doorbell"
        try:
            head = frames.parse(memoryview(lead)[bell.FRAME_AT :])
            method, rid = head.method, head.request_id
            call = calls.BY_METHOD.get(method)
            if head.type != frames.CALL or call is None or call.streams_data:
                raise frames.FrameError(
                    _INVALID,
                    f"doorbell: expected a CALL frame of a compute or control call, got "
                    f"{frames.TYPE_NAMES[head.type]} method {method}",
                    rid,
                )
            kind = call.kind
            n = bell.frame_bytes(head)
            if n > room:
                raise frames.FrameError(
                    _INVALID,
                    f"doorbell: request slot {slot} frame: expected <= {room} bytes, got {n}",
                    rid,
                )
            if out_len:
                seg.check(out_off, out_len, "doorbell.output")
            # One copy out of the segment: the client cannot change what was checked.
            raw = seg.read(off + bell.FRAME_AT + frames.HEADER_BYTES, n - frames.HEADER_BYTES, kind)
            data = memoryview(raw)[head.body_bytes :]
            out = None
            if self.fast is not None and method in FastCalls.METHODS:  # in C (fastpath.py)
                out = self.fast.run(method, memoryview(raw)[: head.body_bytes], data,
                                    self.stream.owner, "shm", seg.view)  # fmt: skip
            if out is None:
                try:
                    request = call.request.FromString(raw[: head.body_bytes])
                except DecodeError:
                    raise frames.FrameError(
                        _INVALID, f"{kind}: the body is not a {call.request.__name__} message", rid
                    ) from None
                staging.check(request, data, seg.check, kind)
        except (frames.FrameError, ValueError, ShmError) as exc:
            code = exc.code if isinstance(exc, frames.FrameError) else _INVALID
            message = exc.message if isinstance(exc, frames.FrameError | ShmError) else str(exc)
            self.stream.servicer.dispatch.refused(
                kind, grpc.StatusCode.INVALID_ARGUMENT, time.perf_counter() - t0, "shm"
            )
            return self._error(method, rid, code, message)
        sink: list = []
        if out is None:
            io = ArrayIO(staging.source(data, seg.read, kind, seg.view), sink)
            out = self.stream.servicer.dispatch.run(
                call, request, self.stream.owner, io, transport="shm"
            )
        self.calls += 1
        if not out.ok:
            return self._error(method, rid, out.code.value[0], out.message)
        return self._reply(call, rid, out.response, sink, out_off, out_len, room)

    def _reply(
        self,
        call: calls.Call,
        rid: int,
        response,
        sink: list,
        out_off: int,
        out_len: int,
        room: int,
    ) -> bytes:
        """The REPLY frame: result arrays in the output region when they all fit, else in
        the frame's data when the frame fits the slot, else RESOURCE_EXHAUSTED. (A
        ``FastReply``, the compiled path's, has one result array, in no sink.)"""
        seg = self.segment
        pieces: list = []
        n = 0
        if isinstance(response, FastReply):
            y = response.y.data.cast("B")
            if len(y) <= out_len:
                seg.write(out_off, y)
                body = response.body(True, out_off)
            else:
                body, pieces, n = response.staged()
        else:
            arrays = [a for a in staging.iter_arrays(response) if a.HasField("staged")]
            need = 0  # each array 64-byte aligned after the one before
            for a in arrays:
                size = memoryview(sink[a.staged.offset]).nbytes
                need = (need + ALIGN - 1) // ALIGN * ALIGN + size
            if arrays and need <= out_len:
                pos = out_off
                for a in arrays:
                    view = memoryview(sink[a.staged.offset]).cast("B")
                    seg.write(pos, view)
                    a.ClearField("staged")
                    a.shm.offset, a.shm.length = pos, len(view)
                    pos += (len(view) + ALIGN - 1) // ALIGN * ALIGN
            else:
                pieces, n = frames.place(response, sink)
            body = response.SerializeToString()
        if frames.HEADER_BYTES + len(body) + n > room:
            return self._error(
                call.method,
                rid,
                _EXHAUSTED,
                f"{call.kind}: the result ({n} bytes) fits neither the output region offered "
                f"({out_len} bytes) nor the doorbell slot ({room} bytes); give the session more "
                f"shm_bytes",
            )
        return b"".join(frames.frame(frames.REPLY, call.method, rid, body, pieces, n))

    @staticmethod
    def _error(method: int, rid: int, code: int, message: str) -> bytes:
        return b"".join(frames.error_frame(method, rid, code, message))


__all__ = ["Doorbell", "check_slots"]
