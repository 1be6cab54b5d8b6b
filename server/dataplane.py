"""The socket data plane: every call of ``service Worker`` but Session, in frames
(``proto/FRAMES.md``) on a plain TCP, Unix or TLS socket, beside gRPC.

    listener thread ──accept──► one thread per connection:
                                HELLO (bounded, timed) ─► owner
                                loop: header ─► body ─► data ─► Dispatch.run ─► REPLY

A connection's thread reads a call and runs it itself: no thread hand-off at decode. It polls
the socket ``--data-spin-us`` before it sleeps, so a client's next call is picked up in a few
microseconds. Calls on one connection run one at a time in arrival order (a client may send
many before reading replies; ragged attention on one kv_b is thus ordered); parallel work
takes parallel connections. Frame sizes are checked against the limits before any buffer is
allocated; a frame that breaks the format is answered once and ends the connection; every
other error is an ordinary REPLY with the call's status. Upload and Update stream their data
straight into the upload pipeline (hashed and placed while it arrives); a refused one is
answered at once and its remaining bytes are read and dropped.

Authentication is the gRPC rule: with tokens configured, the HELLO carries a bearer token or
a one-time ticket (``DataTicket``) and the connection acts as that owner; the listener binds
``--host`` like gRPC, and TLS uses gRPC's certificate (mutual TLS with ``--tls-client-ca``).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from coliworker.server.config import Config
from coliworker.server.errors import WorkerError
from coliworker.server.fastpath import FastCalls, FastReply
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, frames, staging
from coliworker.wire.codec import ArrayIO

log = logging.getLogger(__name__)

_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_ISSUE = calls.BY_KIND["expert_group_issue"].method
_UPLOADS = frozenset(c.method for c in calls.CALLS if c.streams_data)
#: Pieces of an upload's data handed to the upload pipeline at a time.
UPLOAD_PIECE = 1 << 20
#: Frames from this size on are read into the connection's reused buffer (smaller ones into
#: fresh memory: cheap, and never shared with a call still running).
SCRATCH_FROM = 4 << 20
#: Frames from this size on are admitted against the owner's --max-staged-bytes-per-owner
#: (uploads are admitted by the upload path itself).
STAGE_FROM = 1 << 20
#: The rest of a refused upload's data read and dropped at most; beyond, the connection ends.
DRAIN_BYTES = 256 << 20


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The server TLS context of --tls-cert/--tls-key (mutual with --tls-client-ca)."""
    if not config.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        ctx.load_verify_locations(config.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class DataPlane:
    """The listeners and connections of one worker's data plane."""

    def __init__(self, servicer: Any, config: Config) -> None:
        self.servicer = servicer
        self.config = config
        self.tls = tls_context(config)
        self.listeners: list[socket.socket] = []
        self.port = 0
        self.unix_path = ""
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._per_owner: dict[str, int] = {}  # authenticated connections by owner
        self._threads: list[threading.Thread] = []
        self._stopping = False
        port = config.data_bind_port
        if port is not None:
            family = socket.AF_INET6 if ":" in config.host.strip("[]") else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((config.host.strip("[]"), port))
            except OSError as exc:
                s.close()
                raise OSError(
                    f"--data-port {port}: cannot listen on {config.host}:{port}: {exc.strerror}"
                    f" (pick another with --data-port, or 'off')"
                ) from None
            s.listen(128)
            self.port = s.getsockname()[1]
            self.listeners.append(s)
        if config.data_unix_socket:
            path = config.data_unix_socket
            if os.path.exists(path) and not os.path.isdir(path):
                os.unlink(path)  # a stale socket of an earlier run
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.bind(path)
            os.chmod(path, 0o600)
            u.listen(128)
            self.unix_path = path
            self.listeners.append(u)

    @property
    def endpoint(self) -> tuple[int, str, bool]:
        """(TCP port, Unix socket path, TLS) for ``InfoResponse``."""
        return self.port, self.unix_path, self.tls is not None

    def start(self) -> DataPlane:
        for s in self.listeners:
            t = threading.Thread(target=self._accept, args=(s,), name="data-accept", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = len(self._connections) >= self.config.max_data_connections
                if not full and not self._stopping:
                    conn = _Connection(self, sock)
                    self._connections.add(conn)
            if full or self._stopping:
                _refuse(sock, full, self.config.max_data_connections)
                continue
            threading.Thread(target=conn.run, name="data-conn", daemon=True).start()

    def _gone(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)
            if conn.counted:
                left = self._per_owner[conn.owner] - 1
                if left:
                    self._per_owner[conn.owner] = left
                else:
                    del self._per_owner[conn.owner]

    def admit(self, conn: _Connection) -> int | None:
        """Count an authenticated connection against its owner's share (half of
        --max-data-connections, so no owner can take them all); None when admitted, else
        the share."""
        share = max(1, self.config.max_data_connections // 2)
        with self._lock:
            n = self._per_owner.get(conn.owner, 0)
            if n >= share:
                return share
            self._per_owner[conn.owner] = n + 1
            conn.counted = True
        return None

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting; idle connections close now, busy ones after their call (at most
        ``grace`` seconds; None: now)."""
        self._stopping = True
        for s in self.listeners:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self.unix_path:
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass
        deadline = time.monotonic() + (grace or 0.0)
        while True:
            with self._lock:
                live = list(self._connections)
            for c in live:
                if not c.busy or time.monotonic() >= deadline:
                    c.io.shutdown()
            if not live or time.monotonic() >= deadline + 1.0:
                return
            time.sleep(0.01)


def _refuse(sock: socket.socket, full: bool, limit: int) -> None:
    """Answer a connection that cannot be served with one WELCOME error, then close."""
    try:
        sock.setblocking(True)
        sock.settimeout(0.5)
        text = (
            f"data plane: {limit} connections open, the limit (--max-data-connections)"
            if full
            else "data plane: the worker is shutting down"
        )
        msg = text.encode()
        code = _EXHAUSTED if full else _UNAVAILABLE
        sock.sendall(frames.pack(frames.WELCOME, 0, 0, code, len(msg), 0) + msg)
    except OSError:
        pass
    finally:
        sock.close()


class _Connection:
    """One data-plane connection and the thread that serves it."""

    def __init__(self, plane: DataPlane, sock: socket.socket) -> None:
        self.plane = plane
        self.servicer = plane.servicer
        self.dispatch = plane.servicer.dispatch
        self.fast = plane.servicer.fastcalls  # the decode calls' compiled path, or None
        self.sock = sock
        self.io: frames.FrameSocket = frames.FrameSocket(
            sock, plane.config.data_spin_us, plane.config.data_stall_timeout
        )
        self.owner = ""
        self.busy = False
        self.counted = False  # counted in its owner's share of the connections
        self._big: np.ndarray | None = None  # the last large frame's buffer, reused

    def _scratch(self, head: frames.Header) -> np.ndarray | None:
        """A reused buffer for a large frame (its data is consumed before the reply:
        the backends copy what they keep), or None for a fresh one."""
        n = head.body_bytes + head.data_bytes + frames.ALIGN
        if n < SCRATCH_FROM or head.method == _ISSUE:  # issued work outlives its frame
            return None
        if self._big is None or self._big.nbytes < n:
            self._big = None
            self._big = np.empty(n, np.uint8)
        return self._big

    def run(self) -> None:
        try:
            if self._handshake():
                self._serve()
        except frames.Closed:
            pass
        except frames.FrameError as exc:
            self._send_quiet(frames.error_frame(0, exc.request_id, exc.code, exc.message))
        except frames.Stalled as exc:
            log.info(
                "data connection of owner %r closed: %s (--data-stall-timeout)", self.owner, exc
            )
        except (OSError, TimeoutError) as exc:
            log.debug("data connection ended: %s", exc)
        except Exception:
            log.exception("data connection failed")
        finally:
            self.io.close()
            self.plane._gone(self)

    def _send_quiet(self, buffers: list) -> None:
        try:
            self.io.send(buffers)
        except (frames.Closed, OSError):
            pass

    # -- HELLO ------------------------------------------------------------------------------

    def _handshake(self) -> bool:
        """TLS (when configured) and the HELLO, within HELLO_TIMEOUT_S; True when the
        connection is the owner's from now on."""
        deadline = time.monotonic() + frames.HELLO_TIMEOUT_S
        if self.plane.tls is not None and self.sock.family != socket.AF_UNIX:
            self.sock.setblocking(True)
            self.sock.settimeout(frames.HELLO_TIMEOUT_S)
            try:
                tls = self.plane.tls.wrap_socket(self.sock, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.debug("data connection: TLS handshake failed: %s", exc)
                return False
            self.sock = tls
            self.io = frames.FrameSocket(
                tls, self.plane.config.data_spin_us, self.plane.config.data_stall_timeout
            )
        head = self.io.recv_header(deadline, hard=True)
        if head.type != frames.HELLO or head.data_bytes or head.body_bytes > frames.MAX_HELLO_BYTES:
            self._welcome_error(
                _INVALID,
                f"data plane: expected a HELLO frame of at most {frames.MAX_HELLO_BYTES} "
                f"body bytes and no data, got {frames.TYPE_NAMES[head.type]} with "
                f"{head.body_bytes} body and {head.data_bytes} data bytes",
            )
            return False
        body = self.io.recv_bytes(head.body_bytes, deadline, hard=True)
        try:
            hello = pb.DataHello.FromString(bytes(body))
        except DecodeError:
            self._welcome_error(_INVALID, "hello: the body is not a DataHello message")
            return False
        if hello.version != frames.VERSION:
            self._welcome_error(
                _INVALID, f"hello.version: expected {frames.VERSION}, got {hello.version}"
            )
            return False
        owner = self._authenticate(hello)
        if owner is None:
            return False
        self.owner = owner
        share = self.plane.admit(self)
        if share is not None:
            self._welcome_error(
                _EXHAUSTED,
                f"data plane: this owner has {share} connections open, its share of "
                f"--max-data-connections {self.plane.config.max_data_connections}; close some",
            )
            return False
        c = self.plane.config
        welcome = pb.DataWelcome(
            version=frames.VERSION,
            instance_id=self.servicer.instance_id,
            max_frame_bytes=c.max_frame_bytes,
        ).SerializeToString()
        self.io.send(frames.frame(frames.WELCOME, 0, 0, welcome))
        return True

    def _authenticate(self, hello: pb.DataHello) -> str | None:
        tokens = self.servicer.tokens
        if hello.token and hello.ticket:
            self._welcome_error(_INVALID, "hello: expected a token or a ticket, got both")
            return None
        if hello.ticket:
            owner = self.servicer.data_tickets.redeem(hello.ticket)
            if owner is None:
                self._welcome_error(
                    _UNAUTHENTICATED, "hello.ticket: unknown, used or expired ticket"
                )
            return owner
        if tokens is None:
            return ""
        if not hello.token:
            self._welcome_error(
                _UNAUTHENTICATED, "hello: this worker needs a bearer token or a ticket"
            )
            return None
        owner = tokens.owner_of(hello.token)
        if owner is None:
            self._welcome_error(_UNAUTHENTICATED, "hello.token: invalid bearer token")
        return owner

    def _welcome_error(self, code: int, message: str) -> None:
        text = message.encode()
        self._send_quiet([frames.pack(frames.WELCOME, 0, 0, code, len(text), 0), text])

    # -- calls ------------------------------------------------------------------------------

    def _serve(self) -> None:
        limit = self.plane.config.max_frame_bytes
        idle = self.plane.config.data_idle_timeout
        while not self.plane._stopping:
            try:
                head = self.io.recv_header(time.monotonic() + idle if idle else None)
            except frames.Stalled:  # half a header: the caller's stall handling
                raise
            except TimeoutError:
                log.info("data connection of owner %r closed: no call for %g s "
                         "(--data-idle-timeout)", self.owner, idle)  # fmt: skip
                return
            self.busy = True
            try:
                n = head.body_bytes + head.data_bytes
                if STAGE_FROM <= n <= limit and head.method not in _UPLOADS:
                    # a large frame is host memory this owner holds until its call is done
                    if not self._admit(head, n):
                        continue
                    try:
                        self._frame(head, limit)
                    finally:
                        self.servicer.owners.unstage(self.owner, n)
                else:
                    self._frame(head, limit)
            finally:
                self.busy = False

    def _admit(self, head: frames.Header, n: int) -> bool:
        """Admit a large frame against the owner's staged host bytes; when refused, answer
        RESOURCE_EXHAUSTED and read past the frame (False)."""
        call = calls.BY_METHOD.get(head.method)
        kind = call.kind if call is not None else "frame"
        try:
            self.servicer.owners.stage(self.owner, n, kind)
        except WorkerError as exc:
            self.io.send(frames.error_frame(head.method, head.request_id, _EXHAUSTED, exc.message))
            self._drop(n)
            return False
        return True

    def _frame(self, head: frames.Header, limit: int) -> None:
        rid, method = head.request_id, head.method
        if head.type != frames.CALL:
            raise frames.FrameError(
                _INVALID, f"frame.type: expected CALL (3), got {head.type}", rid
            )
        call = calls.BY_METHOD.get(method)
        if call is None or method not in calls.DATA_PLANE:
            raise frames.FrameError(
                _INVALID,
                f"frame.method: expected one of {sorted(calls.DATA_PLANE)}, got {method}",
                rid,
            )
        if head.status:
            raise frames.FrameError(_INVALID, f"frame.status: expected 0, got {head.status}", rid)
        if not call.streams_data and head.body_bytes + head.data_bytes > limit:
            raise frames.FrameError(
                _EXHAUSTED,
                f"{call.kind}: frame of {head.body_bytes + head.data_bytes} bytes exceeds "
                f"{limit} (--max-frame-bytes)",
                rid,
            )
        t0 = time.perf_counter()
        if call.streams_data:  # the data goes to the upload pipeline as it arrives
            body: Any = self.io.recv_bytes(head.body_bytes)
        else:
            body, data = self.io.recv_rest(head, self._scratch(head))
            if self.fast is not None and method in FastCalls.METHODS:
                out = self.fast.run(method, body, data, self.owner, "socket")
                if out is not None:  # read and run in C (server/fastpath.py)
                    self._reply(call, rid, out, [])
                    return
        try:
            request = call.request.FromString(body)
        except DecodeError:
            if call.streams_data:
                self.io.discard(head.data_bytes)
            message = (
                f"{call.kind}: the body is not a {call.request.__name__} message "
                f"({head.body_bytes} bytes)"
            )
            self._refused(call, rid, _INVALID, message, t0)
            return
        if call.streams_data:
            self._upload(call, request, head, t0)
            return
        try:
            external = staging.check(request, data, None, call.kind)
        except ValueError as exc:
            self._refused(call, rid, _INVALID, str(exc), t0)
            return
        sink: list = []
        io = ArrayIO(staging.source(data, None, call.kind) if external else None, sink)
        out = self.dispatch.run(call, request, self.owner, io, transport="socket")
        self._reply(call, rid, out, sink)

    def _refused(self, call: calls.Call, rid: int, code: int, message: str, t0: float) -> None:
        self.io.send(frames.error_frame(call.method, rid, code, message))
        status = grpc.StatusCode.INVALID_ARGUMENT if code == _INVALID else grpc.StatusCode.UNKNOWN
        self.dispatch.refused(call.kind, status, time.perf_counter() - t0, "socket")

    def _reply(self, call: calls.Call, rid: int, out: Any, sink: list) -> None:
        if not out.ok:
            self.io.send(frames.error_frame(call.method, rid, out.code.value[0], out.message))
            return
        rep = out.response
        if isinstance(rep, FastReply):  # the compiled path's: its bytes written in C
            body, pieces, n = rep.staged()
        else:
            pieces, n = frames.place(rep, sink) if sink else ([], 0)
            body = rep.SerializeToString()
        self.io.send(frames.frame(frames.REPLY, call.method, rid, body, pieces, n))

    def _upload(self, call: calls.Call, header: pb.UploadHeader, head: frames.Header, t0: float):
        """Upload / Update: the frame's data goes to the upload pipeline as it arrives."""
        total = head.data_bytes
        expected = header.weight_bytes + header.scale_bytes
        if total != expected:
            self._refused(
                call,
                head.request_id,
                _INVALID,
                f"{call.kind}: frame data_bytes: expected {expected} (header weight_bytes + "
                f"scale_bytes), got {total}",
                t0,
            )
            self._drop(total)
            return
        state = {"read": 0, "closed": False}
        pieces = self._pieces(total, state)
        out = self.dispatch.run(call, header, self.owner, data=pieces, transport="socket")
        if state["closed"]:
            raise frames.Closed(partial=True)  # the client went away mid-data: nobody to answer
        self._reply(call, head.request_id, out, [])  # a refusal is answered at once
        self._drop(total - state["read"])

    def _drop(self, rest: int) -> None:
        """Read past the rest of a refused upload's data, so the connection stays in step;
        more than DRAIN_BYTES ends the connection instead (the reply has gone out)."""
        if rest > DRAIN_BYTES:
            raise frames.Closed()
        if rest:
            self.io.discard(rest)

    def _pieces(self, total: int, state: dict) -> Iterator[memoryview]:
        """The upload's data, UPLOAD_PIECE bytes at a time, read from the socket into one
        reused buffer (the pipeline copies each piece before asking for the next)."""
        buf = bytearray(min(UPLOAD_PIECE, total) or 1)
        view = memoryview(buf)
        while state["read"] < total:
            k = min(len(buf), total - state["read"])
            try:
                self.io.recv_exact(view[:k], first=False)
            except frames.Closed:
                state["closed"] = True
                raise
            state["read"] += k
            yield view[:k]


__all__ = ["DataPlane", "tls_context"]
