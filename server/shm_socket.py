"""The worker's attach socket: how a client's sealed memfd reaches the Session stream that
asked for it (the protocol is in ``coliworker.wire.shm``'s module doc, steps 2-3).

One Unix socket per worker, ``<shm dir>/coliworker-attach-<pid>-<16 hex>/socket``, in a
directory of mode 0700 (another uid cannot even connect); SO_PEERCRED is checked too. A
Session's ``attach_shm`` takes a one-time ticket here (``expect``: one per stream, the
newest replaces the one before, void after ``TICKET_TTL_S``); a connection brings the
ticket and the memfd, which is checked, allocated and mapped (``Segment.adopt``) and handed
to that stream (``SessionStream.attach_segment``). Connections are served one at a time on
one thread, each within ``PASS_TIMEOUT_S``; every failure is answered with its status on
the connection, which is then closed, and the thread takes the next one.

A worker killed before it removed its directory leaves it behind; the next worker of the
same uid removes such directories whose process is gone (``sweep_stale``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from coliworker.server.dispatch import status_of
from coliworker.server.errors import WorkerError
from coliworker.wire import shm
from coliworker.wire.shm import PASS_BYTES, PASS_MAGIC, PASS_TIMEOUT_S, Segment, ShmError

log = logging.getLogger(__name__)

#: How long a ticket an attach_shm gave out may be used.
TICKET_TTL_S = 30.0
_DIR = re.compile(r"^coliworker-attach-(\d+)-[0-9a-f]{16}$")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def check_peer(uid: int, pid: int) -> None:
    """ShmError("permission") unless the peer runs as the worker's uid."""
    if uid != shm.worker_uid():
        raise ShmError(
            "permission",
            f"shm socket: the peer (pid {pid}) runs as uid {uid}, expected the worker's uid "
            f"{shm.worker_uid()} (shared memory is shared within one uid only)",
        )


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove this uid's attach-socket directories whose creating process is gone."""
    return shm.sweep_stale(directory, _DIR)


@dataclass
class _Pending:
    stream: Any  # the SessionStream the ticket was given to
    size: int
    deadline: float  # time.monotonic()


class AttachSocket:
    """The attach socket of one worker (module doc). ``path`` is "" when it could not be
    made (then every ``attach_shm`` is FAILED_PRECONDITION with ``error``)."""

    def __init__(self, directory: str | None = None) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._by_stream: dict[int, bytes] = {}  # id(stream) -> its ticket
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dir = self.path = self.error = ""
        base = directory or shm.shm_dir()
        sweep_stale(base)
        name = f"coliworker-attach-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(base, name)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # the umask cannot widen it, but make it exact
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(os.path.join(path, "socket"))
                sock.listen(64)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            shutil.rmtree(path, ignore_errors=True)
            self.error = f"its attach socket in {base} could not be made: {exc}"
            log.warning("shared memory off: %s", self.error)
            return
        self._sock, self.dir, self.path = sock, path, os.path.join(path, "socket")

    def start(self) -> None:
        if self._sock is not None and self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="shm-attach", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop accepting, remove the directory, void every ticket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._by_stream.clear()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(PASS_TIMEOUT_S + 1)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- tickets (Session streams) --------------------------------------------------------

    def expect(self, stream: Any, size: int) -> bytes:
        """A new ticket for ``stream`` to attach a segment of ``size`` bytes with; voids the
        stream's previous one. ShmError("not_found") when this worker has no socket."""
        if not self.path:
            raise ShmError(
                "not_found", f"attach_shm: this worker serves no shared memory: {self.error}"
            )
        ticket = secrets.token_bytes(shm.TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            old = self._by_stream.pop(id(stream), None)
            if old is not None:
                self._pending.pop(old, None)
            self._pending[ticket] = _Pending(stream, size, now + TICKET_TTL_S)
            self._by_stream[id(stream)] = ticket
        return ticket

    def forget(self, stream: Any) -> None:
        """The stream ended: void its ticket."""
        with self._lock:
            ticket = self._by_stream.pop(id(stream), None)
            if ticket is not None:
                self._pending.pop(ticket, None)

    def waiting(self, stream: Any) -> bool:
        """``stream`` holds a ticket not yet used nor expired: its client is passing a
        segment (a Session attaching is not idle, however slow the handshake)."""
        with self._lock:
            ticket = self._by_stream.get(id(stream))
            p = self._pending.get(ticket) if ticket is not None else None
            return p is not None and p.deadline > time.monotonic()

    def pending(self) -> int:
        """Tickets given out and not yet used or void (for tests and diagnostics)."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._pending)

    def _expire(self, now: float) -> None:
        for ticket, p in [(t, p) for t, p in self._pending.items() if p.deadline <= now]:
            del self._pending[ticket]
            if self._by_stream.get(id(p.stream)) == ticket:
                del self._by_stream[id(p.stream)]

    def _take(self, ticket: bytes) -> _Pending:
        with self._lock:
            self._expire(time.monotonic())
            p = self._pending.pop(ticket, None)
            if p is not None and self._by_stream.get(id(p.stream)) == ticket:
                del self._by_stream[id(p.stream)]
        if p is None:
            raise ShmError(
                "not_found",
                f"shm socket: ticket {ticket[:4].hex()}...: no attach_shm of this worker gave "
                f"it out, or it was used, replaced or void after {TICKET_TTL_S:.0f} s",
            )
        return p

    # -- the socket thread ----------------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and the like: try again, never spin
                continue
            with conn:
                try:
                    code, message = self._handle(conn)
                except (ShmError, WorkerError) as exc:
                    status, message = status_of(exc, "attach_shm")
                    code = status.value[0]
                except OSError as exc:  # the peer stalled (PASS_TIMEOUT_S) or went away
                    code = grpc.StatusCode.UNAVAILABLE.value[0]
                    message = f"shm socket: {exc}"
                except Exception as exc:  # whatever a connection does, the thread carries on
                    status, message = status_of(exc, "attach_shm")  # logged: a worker bug
                    code = status.value[0]
                try:
                    conn.sendall(bytes((code,)) + message.encode())
                except OSError:
                    pass  # the client went away; nothing is attached that it would miss

    def _handle(self, conn: socket.socket) -> tuple[int, str]:
        """Receive one memfd and attach it; (status code value, message) to answer."""
        conn.settimeout(PASS_TIMEOUT_S)
        pid, uid, _ = peer_credentials(conn)
        try:
            check_peer(uid, pid)
        except ShmError:
            conn.recv(PASS_BYTES)  # dropped unread (a plain recv closes passed descriptors),
            raise  # so that closing after the answer does not reset it away
        msg, fds, _, _ = socket.recv_fds(conn, PASS_BYTES, 1)
        try:
            while len(msg) < PASS_BYTES:  # the descriptor came with the first bytes
                more = conn.recv(PASS_BYTES - len(msg))
                if not more:
                    break
                msg += more
            if len(msg) != PASS_BYTES or not msg.startswith(PASS_MAGIC):
                raise ShmError(
                    "invalid",
                    f"shm socket: expected {PASS_MAGIC!r} and a {shm.TICKET_BYTES}-byte ticket "
                    f"({PASS_BYTES} bytes), got {len(msg)} bytes",
                )
            if len(fds) != 1:
                raise ShmError(
                    "invalid", f"shm socket: expected 1 descriptor (SCM_RIGHTS), got {len(fds)}"
                )
            p = self._take(msg[len(PASS_MAGIC) :])
            p.stream.touch()  # the handshake is activity: its idle time starts again here
            fd = fds.pop()
            seg = Segment.adopt(fd, p.size)  # closes fd
        finally:
            for fd in fds:
                os.close(fd)
        log.debug("segment %s (%d bytes) from pid %d attached", seg.name, seg.size, pid)
        return p.stream.attach_segment(seg)


__all__ = ["TICKET_TTL_S", "AttachSocket", "check_peer", "peer_credentials", "sweep_stale"]
