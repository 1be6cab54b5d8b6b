"""The data plane's frames (``proto/FRAMES.md`` is the specification) and the socket I/O
both ends use: a 32-byte little-endian header, a protobuf body, then the array bytes.

``FrameSocket`` reads and writes frames on a connected socket (TCP, Unix or TLS). A reader
polls the non-blocking socket for ``spin_us`` before it blocks (a sleeping thread takes tens
of microseconds to wake, a decode call's whole budget), yielding the core between polls
so two spinning peers on one core still make progress.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import Message

from coliworker.wire import staging

MAGIC = b"CWF1"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_BYTES = HEADER.size  # 32
HELLO, WELCOME, CALL, REPLY = 1, 2, 3, 4
TYPE_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", CALL: "CALL", REPLY: "REPLY"}
#: Largest body of any frame (a call's message without its arrays is far smaller).
MAX_BODY_BYTES = 4 << 20
#: Largest HELLO body, and how long a new connection may take to send it.
MAX_HELLO_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
#: Writers start each array at a multiple of this many bytes into a frame's data.
ALIGN = 64
#: Default poll time of a reader before it blocks.
SPIN_US = 200
_PAD = bytes(ALIGN)


class FrameError(Exception):
    """A frame that breaks the format: ``code`` is the gRPC status value to answer with,
    ``request_id`` the id as read (0 if none)."""

    def __init__(self, code: int, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


class Closed(Exception):
    """The peer closed the connection (``partial``: in the middle of a frame)."""

    def __init__(self, partial: bool = False) -> None:
        super().__init__("connection closed mid-frame" if partial else "connection closed")
        self.partial = partial


class Stalled(TimeoutError):
    """A frame stopped moving: no byte received (or sent) for ``seconds`` in its middle."""

    def __init__(self, seconds: float, direction: str) -> None:
        super().__init__(f"no byte to {direction} for {seconds:g} s in the middle of a frame")
        self.seconds = seconds


@dataclass(frozen=True, slots=True)
class Header:
    type: int
    method: int
    request_id: int
    status: int
    body_bytes: int
    data_bytes: int
    flags: int = 0


def pack(
    type_: int, method: int, request_id: int, status: int, body_bytes: int, data_bytes: int
) -> bytes:
    return HEADER.pack(MAGIC, type_, 0, method, request_id, status, body_bytes, data_bytes)


def parse(buf: bytes | bytearray | memoryview) -> Header:
    """The header in the first 32 bytes; FrameError (INVALID_ARGUMENT) if malformed."""
    magic, type_, flags, method, rid, status, body, data = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(3, f"frame.magic: expected {MAGIC.hex()}, got {bytes(magic).hex()}")
    if type_ not in TYPE_NAMES:
        raise FrameError(3, f"frame.type: expected 1..4, got {type_}", rid)
    if flags:
        raise FrameError(3, f"frame.flags: expected 0, got {flags}", rid)
    if body > MAX_BODY_BYTES:
        raise FrameError(8, f"frame.body_bytes: expected <= {MAX_BODY_BYTES}, got {body}", rid)
    return Header(type_, method, rid, status, body, data, flags)


def place(msg: Message, side: Sequence[Any]) -> tuple[list[Any], int]:
    """Give ``msg``'s out-of-message arrays their frame data offsets. Each Array with
    ``staged.offset = i`` holds its bytes in ``side[i]`` (``codec.encode`` with a sink); it
    gets the offset of those bytes in the data, 64-byte aligned. Returns the buffers of
    the data in order and its length."""
    pieces: list[Any] = []
    offset = 0
    for a in staging.iter_arrays(msg):
        if not a.HasField("staged") or a.data:
            continue
        view = memoryview(side[a.staged.offset]).cast("B")
        pad = -offset % ALIGN
        if pad:
            pieces.append(_PAD[:pad])
            offset += pad
        a.staged.offset, a.staged.length = offset, len(view)
        if len(view):
            pieces.append(view)
        offset += len(view)
    return pieces, offset


def frame(
    type_: int,
    method: int,
    request_id: int,
    body: bytes,
    data: Sequence[Any] = (),
    data_bytes: int = 0,
    status: int = 0,
) -> list[Any]:
    """The buffers of one frame: header, body, data pieces."""
    return [pack(type_, method, request_id, status, len(body), data_bytes), body, *data]


def error_frame(method: int, request_id: int, code: int, message: str) -> list[Any]:
    text = message.encode("utf-8", "replace")[:65536]
    return frame(REPLY, method, request_id, text, status=code)


class FrameSocket:
    """Frame I/O on one connected socket. ``recv_*`` from one thread at a time, ``send``
    from one thread at a time (callers hold their own locks)."""

    def __init__(
        self, sock: socket.socket, spin_us: int = SPIN_US, stall_s: float | None = None
    ) -> None:
        """``stall_s``: once a frame has begun (or while one is being sent), at most this
        long without a byte moving before ``Stalled`` (None: wait for as long as it takes);
        between frames the wait is the caller's ``deadline``."""
        self.sock = sock
        self.stall_s = stall_s or None
        self.spin_ns = max(0, int(spin_us)) * 1000
        self.tls = isinstance(sock, ssl.SSLSocket)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._head = bytearray(HEADER_BYTES)
        self._fd = sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wake a thread blocked reading this socket (it sees the connection closed)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- receiving ------------------------------------------------------------------------

    def _wait(self, events: int, deadline: float | None, stalls: bool = False) -> None:
        """Until the socket is ready for ``events``: TimeoutError past ``deadline``; with
        ``stalls`` (mid-frame) and no deadline, Stalled after ``stall_s`` without progress."""
        if stalls and deadline is None and self.stall_s is not None:
            if not self._poll(events, time.monotonic() + self.stall_s):
                raise Stalled(self.stall_s, "receive" if events == select.POLLIN else "send")
            return
        if not self._poll(events, deadline):
            raise TimeoutError("no data before the deadline")

    def _poll(self, events: int, deadline: float | None) -> bool:
        """False once ``deadline`` has passed with the socket not ready."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        p = select.poll()
        p.register(self._fd, events)
        ms = -1 if timeout is None else int(timeout * 1000) + 1
        return bool(p.poll(ms)) or deadline is None or time.monotonic() < deadline

    def recv_exact(
        self,
        view: memoryview,
        deadline: float | None = None,
        first: bool = True,
        hard: bool = False,
    ) -> None:
        """Fill ``view`` completely. Raises Closed (``partial`` unless nothing of a frame
        was read: ``first`` and no byte yet), TimeoutError past ``deadline`` while no byte
        has come (once a frame has begun the rest is waited for, unless ``hard``: a HELLO
        must be complete by its deadline)."""
        got, n = 0, len(view)
        spin_end = 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except (BlockingIOError, ssl.SSLWantReadError):
                now = time.perf_counter_ns()
                if not spin_end:
                    spin_end = now + self.spin_ns
                if now < spin_end:
                    os.sched_yield()
                    continue
                waiting = (first and got == 0) or hard  # for a frame, not inside one
                self._wait(select.POLLIN, deadline if waiting or got == 0 else None, not waiting)
                spin_end = time.perf_counter_ns() + self.spin_ns
                continue
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, deadline, True)
                continue
            except (ConnectionError, ssl.SSLError) as exc:
                raise Closed(partial=not (first and got == 0)) from exc
            if k == 0:
                raise Closed(partial=not (first and got == 0))
            got += k

    def recv_header(self, deadline: float | None = None, hard: bool = False) -> Header:
        self.recv_exact(memoryview(self._head), deadline, first=True, hard=hard)
        return parse(self._head)

    def recv_bytes(self, n: int, deadline: float | None = None, hard: bool = False) -> bytearray:
        buf = bytearray(n)
        if n:
            self.recv_exact(memoryview(buf), deadline, first=False, hard=hard)
        return buf

    def recv_rest(
        self, head: Header, scratch: np.ndarray | None = None
    ) -> tuple[memoryview, np.ndarray]:
        """The body and the data of the frame whose header was just read, in one read into
        one buffer placed so that the data (right after the body) is 64-byte aligned: a
        fresh one, or ``scratch`` when it is large enough (a reader that is done with the
        previous frame's data before the next: no page faults on every large frame)."""
        nb, nd = head.body_bytes, head.data_bytes
        if scratch is not None and scratch.nbytes >= nb + nd + ALIGN:
            raw = scratch
        else:
            raw = np.empty(nb + nd + ALIGN, np.uint8)
        start = -(raw.ctypes.data + nb) % ALIGN
        buf = raw[start : start + nb + nd]
        if nb + nd:
            self.recv_exact(memoryview(buf), first=False)
        return memoryview(buf[:nb]), buf[nb:]

    def recv_array(self, n: int) -> np.ndarray:
        """``n`` bytes into a fresh 64-byte aligned uint8 array (frame data)."""
        raw = np.empty(n + ALIGN, np.uint8)
        start = -raw.ctypes.data % ALIGN
        out = raw[start : start + n]
        if n:
            self.recv_exact(memoryview(out), first=False)
        return out

    def discard(self, n: int) -> None:
        """Read and drop ``n`` bytes (the rest of a refused upload's data)."""
        scratch = bytearray(min(n, 1 << 20) or 1)
        view = memoryview(scratch)
        while n > 0:
            k = min(n, len(scratch))
            self.recv_exact(view[:k], first=False)
            n -= k

    # -- sending --------------------------------------------------------------------------

    def send(self, buffers: Sequence[Any]) -> None:
        """Write the buffers back to back (a frame, or several), all of them."""
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        if self.tls:  # SSL sockets have no sendmsg
            small = sum(len(b) for b in bufs)
            if small <= 256 << 10:
                bufs = [memoryview(b"".join(bufs))]
            for b in bufs:
                self._send_all(b)
            return
        while bufs:
            try:
                k = self.sock.sendmsg(bufs[:512])
            except BlockingIOError:
                self._wait(select.POLLOUT, None, True)
                continue
            except ConnectionError as exc:
                raise Closed(partial=True) from exc
            while k:
                if k >= len(bufs[0]):
                    k -= len(bufs[0])
                    bufs.pop(0)
                else:
                    bufs[0] = bufs[0][k:]
                    k = 0

    def _send_all(self, view: memoryview) -> None:
        while len(view):
            try:
                k = self.sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(select.POLLOUT, None, True)
                continue
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, None, True)
                continue
            except (ConnectionError, ssl.SSLError) as exc:
                raise Closed(partial=True) from exc
            view = view[k:]


__all__ = [
    "ALIGN",
    "CALL",
    "HEADER_BYTES",
    "HELLO",
    "MAGIC",
    "MAX_BODY_BYTES",
    "Stalled",
    "MAX_HELLO_BYTES",
    "REPLY",
    "VERSION",
    "WELCOME",
    "Closed",
    "FrameError",
    "FrameSocket",
    "Header",
    "error_frame",
    "frame",
    "pack",
    "parse",
    "place",
]
