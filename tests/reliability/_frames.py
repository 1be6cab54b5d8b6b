"""What the data-plane frame tests share (``test_frames_fuzz.py``, ``test_frames_clients.py``):
a NumPy worker with resident tensors and a KV sequence that checks, after each example, that
it still serves exactly and nothing resident changed (``Plane``), and raw frame I/O on a
plain socket."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import numpy as np
import pytest
from _rel import serve
from hypothesis import settings
from test_fuzz import FUZZ, Resident

from coliworker.client import WorkerClient
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec, frames

#: gRPC status values a frame may carry back (OK and the typed refusals).
TYPED = {0, 3, 5, 7, 8, 9, 16}
INVALID, EXHAUSTED = 3, 8
MAX_FRAME = 16 << 20  # the fuzzed worker's --max-frame-bytes
#: A worker that neither answers nor closes within this is hung (not a timing assertion:
#: every answer here is expected at once).
HANG_S = 20.0
#: The shorter bound where an answer is due at once (a refused upload, a timed-out HELLO).
ANSWER_S = 3.0
SMALL = settings(FUZZ, max_examples=40)
PER_METHOD = settings(FUZZ, max_examples=25)
METHODS = sorted(calls.DATA_PLANE)
MATMUL = calls.BY_KIND["matmul"].method
INFO = calls.BY_KIND["info"].method


# -- the worker ------------------------------------------------------------------------------


class Failures(logging.Handler):
    """The worker's logged errors (a connection thread that died of an exception it did
    not expect logs "data connection failed")."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        #: The known bug test_client_gone_mid_upload_is_not_an_internal_error pins: kept
        #: apart so the fuzz tests still catch every other logged error.
        self.upload_closed: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, frames.Closed) and record.getMessage().startswith(
            ("internal error in upload", "internal error in update")
        ):
            self.upload_closed.append(record.getMessage())
        else:
            self.records.append(self.format(record))


class Plane:
    """The fuzzed worker, its resident state and the answers it must keep giving."""

    def __init__(self) -> None:
        self.failures = Failures()
        logging.getLogger("coliworker").addHandler(self.failures)
        self.srv = serve(
            max_message_bytes=4 << 20, memory_limit=256 << 20, max_frame_bytes=MAX_FRAME
        )
        self.w = WorkerClient(self.srv.address, timeout=30, progress=False)
        self.resident = Resident(self.w)
        self.port = self.srv.data.port
        self.want = self.w.matmul(self.resident.h, self.resident.x)  # unary: bit-exact
        self.instance = self.w.info().instance_id
        self.budget = dict(self.srv.servicer.budget.used)

    def check(self) -> None:
        """Nothing resident changed and no device budget is still held by a refused or
        abandoned upload."""
        self.resident.check(self.w)
        assert self.srv.servicer.budget.used == self.budget

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), HANG_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(HANG_S)
        return s

    def hello(self) -> socket.socket:
        """A connection past a valid HELLO (WELCOME OK read)."""
        s = self.connect()
        s.sendall(hello_frame())
        head, body, _ = read_frame(s)
        assert head.type == frames.WELCOME and head.status == 0, body
        return s

    def healthy(self) -> None:
        """A fresh connection gets Info and an exact matmul; no connection thread died of
        an exception."""
        assert not self.failures.records, self.failures.records
        s = self.hello()
        try:
            s.sendall(call_bytes(INFO, 1, pb.InfoRequest()) + matmul_bytes(self, 2))
            got = {}
            for _ in range(2):
                head, body, data = read_frame(s)
                assert head.type == frames.REPLY and head.status == 0, body
                got[head.request_id] = (head, body, data)
            info = pb.InfoResponse.FromString(got[1][1])
            assert info.instance_id == self.instance
            np.testing.assert_array_equal(decode_matmul(got[2][1], got[2][2]), self.want)
        finally:
            s.close()

    def connections_drain(self, base: int) -> None:
        """Connections whose clients went away are released (bounded wait, not timing)."""
        end = time.monotonic() + HANG_S
        while self.srv.data.connections() > base and time.monotonic() < end:
            time.sleep(0.02)
        assert self.srv.data.connections() <= base, "a closed connection is still served"

    def close(self) -> None:
        logging.getLogger("coliworker").removeHandler(self.failures)
        self.w.close()
        self.srv.stop(grace=None)


# -- frames ----------------------------------------------------------------------------------


def hello_frame(**fields: Any) -> bytes:
    body = pb.DataHello(version=1, **fields).SerializeToString()
    return b"".join(bytes(b) for b in frames.frame(frames.HELLO, 0, 0, body))


def call_bytes(method: int, rid: int, request, data: bytes = b"") -> bytes:
    body = request.SerializeToString()
    return frames.pack(frames.CALL, method, rid, 0, len(body), len(data)) + body + data


def matmul_parts(p: Plane) -> tuple[bytes, bytes]:
    side: list = []
    req = pb.MatmulRequest(
        handle=p.resident.h.handle, x=codec.encode(p.resident.x, pb.DTYPE_FLOAT32, side)
    )
    pieces, _ = frames.place(req, side)
    data = b"".join(bytes(x) for x in pieces)
    return req.SerializeToString(), data


def matmul_bytes(p: Plane, rid: int) -> bytes:
    body, data = matmul_parts(p)
    return frames.pack(frames.CALL, MATMUL, rid, 0, len(body), len(data)) + body + data


def decode_matmul(body: bytes, data: bytes) -> np.ndarray:
    mm = pb.MatmulResponse.FromString(body)
    return codec.decode(mm.y, "y", source=lambda a: data[a.staged.offset :][: a.staged.length])


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    """n bytes, or None if the worker closed (or reset) the connection first; a worker that
    neither answers nor closes within HANG_S fails the test."""
    out = bytearray()
    while len(out) < n:
        try:
            k = s.recv(n - len(out))
        except ConnectionResetError:
            return None
        except TimeoutError:
            pytest.fail(f"the worker neither answered nor closed within {HANG_S} s (hung)")
        if not k:
            return None
        out += k
    return bytes(out)


def read_frame(s: socket.socket) -> tuple[frames.Header, bytes, bytes]:
    raw = recv_exact(s, frames.HEADER_BYTES)
    assert raw is not None, "the worker closed the connection without an answer"
    head = frames.parse(raw)
    body = recv_exact(s, head.body_bytes)
    data = recv_exact(s, head.data_bytes)
    assert body is not None and data is not None, "the worker closed mid-frame"
    return head, body, data


def send(s: socket.socket, blob: bytes) -> None:
    """Send what the worker takes (it may close early on a broken frame), then half-close
    so it sees the end of the stream."""
    try:
        s.sendall(blob)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the worker closed first
        pass


def drain(s: socket.socket) -> list[tuple[frames.Header, bytes, bytes]]:
    """Every frame the worker sends until it closes; each must be well formed and typed."""
    out = []
    while True:
        raw = recv_exact(s, frames.HEADER_BYTES)
        if raw is None:
            return out
        head = frames.parse(raw)  # a malformed answer raises here
        assert head.type in (frames.WELCOME, frames.REPLY), head
        assert head.status in TYPED, f"untyped status {head.status}"
        if head.status:
            assert head.data_bytes == 0, head
        body = recv_exact(s, head.body_bytes)
        data = recv_exact(s, head.data_bytes)
        if body is None or data is None:
            return out  # closed while answering: the connection ended
        if head.status:
            body.decode("utf-8")  # an error's body is its message
        out.append((head, body, data))


def exchange(p: Plane, blob: bytes, after_hello: bool = True) -> list:
    s = p.hello() if after_hello else p.connect()
    try:
        send(s, blob)
        return drain(s)
    finally:
        s.close()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def upload_header(n: int, fmt: int = 0) -> pb.UploadHeader:
    """A well-formed fp32 header of about n weight bytes (n rounded down to rows of 4x4)."""
    rows = max(1, n // 16)
    return pb.UploadHeader(
        spec=pb.TensorSpec(fmt=fmt, in_features=4, out_features=rows),
        content_hash=bytes(32),
        weight_bytes=rows * 16,
    )
