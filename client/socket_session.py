"""``SocketSession``: the hot calls over the worker's socket data plane (``proto/FRAMES.md``).

    with WorkerClient(addr) as w, w.session(transport="socket") as s:
        y = s.expert_group_routed_sync(experts, x, routes, weights)

One TCP (or Unix, or TLS) connection to the worker's data port, opened with a HELLO that
authenticates as the client does on gRPC (its bearer token, or a one-time ``DataTicket``
when it has none). Each call is one CALL frame: a 32-byte header, the request message, the
array bytes after it (never inside the message); its answer is one REPLY frame. Any number
of calls may be in flight; there is no reader thread: whichever thread waits for a result
reads replies itself and completes every call answered meanwhile, so a synchronous call
wakes in the thread that made it, after polling the socket ``spin_us`` before it sleeps.
The worker runs one connection's calls in arrival order; open several sessions for
parallel work. An error fails only its own future; a lost connection fails every pending
call with ``Unavailable`` (the recovering client then reconnects and replays them).
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import ssl
import threading
import time
from typing import Any

import grpc

from coliworker.client import errors
from coliworker.client.session_calls import (
    Decoder,
    SessionCalls,
    SessionFuture,
    WaitingFuture,
    raw,
    read_until,
)
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, frames, staging

_STATUS_OF = {c.value[0]: c for c in grpc.StatusCode}
#: How long a thread waiting for a reply polls the socket before it sleeps, us: longer than
#: a decode call's backend time (0.2-0.4 ms on an H200), so the waiting thread is awake
#: when the reply lands (a sleeping one takes ~20-60 us more to wake); it costs that
#: thread's core meanwhile, which at decode waits for the answer anyway.
SPIN_US = 1000
CONNECT_TIMEOUT_S = 10.0
#: A connection unused this long is checked before the next call (the worker may have closed
#: it: --data-idle-timeout) and dialled again if it is gone.
IDLE_CHECK_S = 1.0
_RDHUP = getattr(select, "POLLRDHUP", 0x2000)  # the peer shut its side (Linux)


def _host_of(address: str) -> str:
    """The host part of a gRPC target ("host:port", "[v6]:port", "dns:///host:port")."""
    target = address.split("///", 1)[-1]
    if target.startswith("["):
        return target[1 : target.index("]")]
    return target.rsplit(":", 1)[0] if ":" in target else target


def _tls_context(tls: Any) -> ssl.SSLContext:
    """A client TLS context from the client's ``TLS`` settings (True: system roots)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if tls is True or tls is None:
        return ctx
    ca = getattr(tls, "root_certificates", None)
    if ca:
        ctx.load_verify_locations(cadata=ca.decode() if isinstance(ca, bytes) else ca)
    cert, key = getattr(tls, "certificate_chain", None), getattr(tls, "private_key", None)
    if cert and key:
        import tempfile

        with tempfile.TemporaryDirectory() as d:  # ssl loads key material from files only
            cp, kp = os.path.join(d, "c.pem"), os.path.join(d, "k.pem")
            for path, blob in ((cp, cert), (kp, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(blob if isinstance(blob, bytes) else blob.encode())
            ctx.load_cert_chain(cp, kp)
    return ctx


class SocketSession(SessionCalls):
    """A session on the data plane of ``client`` (use ``WorkerClient.session(transport=
    "socket")``). ``address``: "host:port" or "unix:/path" of the data plane (default: the
    Unix socket the worker reports if this host has it, else the worker's host and
    ``data_port``). ``spin_us``: how long a waiting thread polls before it sleeps.
    ``timeout``: default wait of the sync helpers (the client's when None)."""

    transport = "socket"

    def __init__(
        self,
        client: Any,
        *,
        address: str | None = None,
        spin_us: int = SPIN_US,
        timeout: float | None = None,
    ) -> None:
        self._client = client
        self.wire_dtype = client.wire_dtype
        self.timeout = client.timeout if timeout is None else timeout
        self._tls = threading.local()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reading = threading.Lock()
        self._pending: dict[int, tuple[SessionFuture, Decoder, calls.Call]] = {}
        self._broken: errors.WorkerError | None = None
        self._bell = None  # no doorbell channel (what RecoveringSession asks)
        self._closed = False
        self.segment = None
        info = client._call(client._stub.Info, pb.InfoRequest())
        self.instance_id = info.instance_id
        self.address = address or self._pick(info)
        self._dial = (info.data_tls, spin_us)
        self._io = self._connect(self.address, info.data_tls, spin_us)
        try:
            self._hello(client)
        except BaseException:
            self._io.close()
            raise
        self._last = time.monotonic()  # the last call sent

    # -- connecting -------------------------------------------------------------------------

    def _pick(self, info: pb.InfoResponse) -> str:
        path = info.data_unix_socket
        if path and os.path.exists(path):
            return "unix:" + path
        if not info.data_port:
            raise errors.Unavailable(
                f"data plane: the worker at {self._client.address} serves none (--data-port off)"
            )
        host = _host_of(self._client.address)
        return f"[{host}]:{info.data_port}" if ":" in host else f"{host}:{info.data_port}"

    def _connect(self, address: str, tls: bool, spin_us: int) -> frames.FrameSocket:
        try:
            if address.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(address[5:])
            else:
                host, _, port = address.rpartition(":")
                sock = socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S)
                if tls:
                    ctx = _tls_context(self._client.tls)
                    sock = ctx.wrap_socket(sock, server_hostname=host.strip("[]"))
        except (OSError, ValueError) as exc:
            raise errors.Unavailable(f"data plane: cannot connect to {address}: {exc}") from None
        return frames.FrameSocket(sock, spin_us)

    def _hello(self, client: Any) -> None:
        hello = pb.DataHello(version=frames.VERSION)
        if client.token:
            hello.token = client.token
        elif client.tls is not None:  # TLS (mutual or not) without a token: a one-time
            # ticket carries what the gRPC channel authenticated as to the data plane
            t = client._call(client._stub.DataTicket, pb.DataTicketRequest())
            hello.ticket = t.ticket
        self._io.send(frames.frame(frames.HELLO, 0, 0, hello.SerializeToString()))
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            head = self._io.recv_header(deadline)
            body = bytes(self._io.recv_bytes(head.body_bytes, deadline))
        except (frames.Closed, TimeoutError, OSError) as exc:
            raise errors.Unavailable(f"data plane {self.address}: no WELCOME ({exc})") from None
        if head.type != frames.WELCOME:
            raise errors.InternalError(f"data plane: expected WELCOME, got frame type {head.type}")
        if head.status:
            code = _STATUS_OF.get(head.status, grpc.StatusCode.UNKNOWN)
            raise errors.from_status(code, body.decode("utf-8", "replace"))
        welcome = pb.DataWelcome.FromString(body)
        self.instance_id = welcome.instance_id

    def _redial_if_closed(self, rid: int) -> None:
        """Before a call on a connection idle for ``IDLE_CHECK_S``, with nothing in flight:
        if the worker closed it meanwhile (its --data-idle-timeout), connect again. The
        same worker instance keeps this owner's handles; another instance means the worker
        restarted, which ``RecoveringSession`` handles (Unavailable here). Holds
        ``_send_lock``; ``rid`` is the call about to be sent."""
        p = select.poll()
        p.register(self._io.sock.fileno(), select.POLLIN | _RDHUP)
        events = p.poll(0)
        if not events or not events[0][1] & (_RDHUP | select.POLLHUP | select.POLLERR):
            return
        with self._lock:
            if any(r != rid for r in self._pending):
                return  # a reply is due on it: its reader sees the connection end
        with self._reading:  # free: no other call is in flight
            instance = self.instance_id
            self._io.close()
            self._io = self._connect(self.address, *self._dial)
        self._hello(self._client)
        if self.instance_id != instance:
            err = errors.Unavailable(
                f"data plane {self.address}: the worker restarted (instance {instance} -> "
                f"{self.instance_id}): its handles are gone"
            )
            self._fail(err)
            raise err

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def shm(self) -> bool:
        return False

    @property
    def doorbell(self) -> bool:
        return False

    def close(self, timeout: float | None = 10.0) -> None:
        """Wait for the calls in flight (up to ``timeout`` s), then close the connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [f for f, _, _ in self._pending.values()]
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.wait(fut, left)
            except errors.WorkerError:
                break
        self._fail(errors.Cancelled("session is closed"))
        self._io.shutdown()
        with self._reading:
            self._io.close()

    def _fail(self, err: errors.WorkerError) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = err
            err = self._broken
            pending, self._pending = self._pending, {}
        for fut, _, _ in pending.values():
            fut._set(error=err)

    # -- submitting -------------------------------------------------------------------------

    def _submit(
        self,
        kind: str,
        body: Any,
        decode: Decoder | None,
        out_bytes: int = 0,
        side: list | None = None,
    ) -> SessionFuture:
        side = self._take_side() if side is None else side
        call = calls.BY_KIND[kind]
        rid = next(self._ids)
        fut = WaitingFuture(rid, self)
        pieces, n = frames.place(body, side) if side else ([], 0)
        buffers = frames.frame(frames.CALL, call.method, rid, body.SerializeToString(), pieces, n)
        with self._lock:
            if self._closed or self._broken is not None:
                err = self._broken
                raise (
                    err
                    if err is not None and not self._closed
                    else errors.Cancelled("session is closed")
                )
            self._pending[rid] = (fut, decode or raw, call)
        try:
            with self._send_lock:
                now = time.monotonic()
                if now - self._last > IDLE_CHECK_S:
                    self._redial_if_closed(rid)
                self._last = now
                self._io.send(buffers)
        except (frames.Closed, OSError) as exc:
            self._fail(errors.Unavailable(f"data plane {self.address}: connection lost ({exc})"))
        except errors.WorkerError as exc:  # dialling again failed
            self._fail(exc)
        return fut

    # -- receiving --------------------------------------------------------------------------

    def wait(self, fut: SessionFuture, timeout: float | None) -> None:
        """Return once ``fut`` is done (or ``timeout`` seconds passed), reading replies on
        this thread meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        read_until(fut, deadline, self._reading, self._read_one)

    def _read_one(self, deadline: float | None) -> bool:
        """Read one REPLY and complete its call; False on timeout. Holds ``_reading``."""
        try:
            head = self._io.recv_header(deadline)
            body, data = self._io.recv_rest(head)
        except TimeoutError:
            return False
        except (frames.Closed, frames.FrameError, OSError) as exc:
            self._fail(errors.Unavailable(f"data plane {self.address}: connection lost ({exc})"))
            return True
        with self._lock:
            entry = self._pending.pop(head.request_id, None)
        if entry is None:
            if head.request_id == 0 and head.status:  # the worker refused the framing
                code = _STATUS_OF.get(head.status, grpc.StatusCode.UNKNOWN)
                self._fail(errors.from_status(code, bytes(body).decode("utf-8", "replace")))
            return True
        fut, decode, call = entry
        try:
            value = self._value(head, body, data, decode, call, fut)
        except BaseException as exc:
            fut._set(error=exc)
            return True
        fut._set(value)
        return True

    @staticmethod
    def _value(head: frames.Header, body: Any, data: Any, decode: Decoder, call, fut) -> Any:
        if head.status:
            code = _STATUS_OF.get(head.status, grpc.StatusCode.UNKNOWN)
            raise errors.from_status(code, bytes(body).decode("utf-8", "replace"))
        resp = call.response.FromString(body)
        if staging.check(resp, data, None, "result"):
            return decode(resp, fut, staging.source(data, None, "result"))
        return decode(resp, fut, None)


__all__ = ["SocketSession"]
