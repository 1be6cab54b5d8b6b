"""Data-plane connections whose client stalls or goes away: an idle unauthenticated
connection and a partial HELLO are closed after the HELLO timeout, a client killed -9 in the
middle of a frame or gone mid-upload leaves the worker serving, nothing resident changed,
and no internal error logged (``_frames.Plane``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _frames import (
    ANSWER_S,
    HANG_S,
    INFO,
    call_bytes,
    hello_frame,
    read_frame,
    rss,
    upload_header,
)
from _rel import TOKENS, serve, token_env

from coliworker.client import WorkerClient
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, frames

# -- idle and killed clients -----------------------------------------------------------------


@pytest.fixture
def secured(monkeypatch):
    """A worker with tokens and a short HELLO timeout."""
    monkeypatch.setattr(frames, "HELLO_TIMEOUT_S", 0.3)
    srv = serve(tokens=token_env())
    yield srv
    srv.stop(grace=None)


def closed_by_worker(s: socket.socket) -> bool:
    s.settimeout(HANG_S)
    try:
        while True:
            k = s.recv(4096)
            if not k:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_unauthenticated_connection_is_closed(secured):
    base = secured.data.connections()
    before = rss()
    socks = [socket.create_connection(("127.0.0.1", secured.data.port), HANG_S) for _ in range(16)]
    try:
        for s in socks:
            assert closed_by_worker(s), "an idle connection outlived the HELLO timeout"
    finally:
        for s in socks:
            s.close()
    end = time.monotonic() + HANG_S
    while secured.data.connections() > base and time.monotonic() < end:
        time.sleep(0.02)
    assert secured.data.connections() == base
    assert rss() - before < 16 << 20  # 16 idle connections: a small buffer each
    with WorkerClient(secured.address, token=TOKENS["alice"]) as w:
        with w.session(transport="socket") as s:
            assert s.transport == "socket"
            x = np.ones((1, 4), np.float32)
            t = w.upload(np.eye(4, dtype=np.float32), None, fmt=0, in_features=4, out_features=4)
            np.testing.assert_array_equal(s.matmul_sync(t, x), x)


@pytest.mark.parametrize(
    "partial",
    [
        "header",
        "body",
    ],
)
def test_partial_hello_is_closed_after_the_timeout(secured, partial):
    hello = hello_frame(token=TOKENS["alice"])
    if partial == "header":
        blob = hello[:10]
    else:
        body = pb.DataHello(version=1, token="x" * 90).SerializeToString()
        blob = frames.pack(frames.HELLO, 0, 0, 0, len(body), 0) + body[:10]
    s = socket.create_connection(("127.0.0.1", secured.data.port), HANG_S)
    try:
        s.sendall(blob)
        s.settimeout(ANSWER_S)  # 10x the patched HELLO timeout: a hang, not slowness
        try:
            k = s.recv(4096)
            closed = not k or k[:4] == frames.MAGIC
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        assert closed, "a partial HELLO held its connection past the HELLO timeout"
    finally:
        s.close()


KILLED_CLIENT = textwrap.dedent(
    """
    import socket, sys
    from coliworker.v1 import worker_pb2 as pb
    from coliworker.wire import frames, calls
    port, handle = int(sys.argv[1]), int(sys.argv[2])
    s = socket.create_connection(("127.0.0.1", port))
    hello = pb.DataHello(version=1).SerializeToString()
    s.sendall(frames.pack(frames.HELLO, 0, 0, 0, len(hello), 0) + hello)
    head = s.recv(frames.HEADER_BYTES, socket.MSG_WAITALL)
    assert frames.parse(head).status == 0
    s.recv(frames.parse(head).body_bytes, socket.MSG_WAITALL)
    n = 10 << 20
    x = pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[n // 64, 16], staged=pb.Slice(length=n))
    body = pb.MatmulRequest(handle=handle, x=x).SerializeToString()
    head = frames.pack(frames.CALL, calls.BY_KIND["matmul"].method, 1, 0, len(body), n)
    s.sendall(head + body + bytes(n // 2))  # half of the frame's data
    print("sent", flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_client_killed_mid_frame(plane):
    base = plane.srv.data.connections()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, str(plane.port), str(plane.resident.h.handle)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "sent"
        plane.healthy()  # serving while that frame hangs half sent
        proc.kill()
        proc.wait(HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_S)
        proc.stdin.close()
        proc.stdout.close()
    plane.connections_drain(base)
    plane.healthy()
    plane.check()


def test_client_gone_mid_upload_is_not_an_internal_error(plane):
    base = plane.srv.data.connections()
    plane.failures.upload_closed.clear()
    header = upload_header(1 << 20)  # 1 MiB, accepted at the header
    hb = header.SerializeToString()
    method = calls.BY_KIND["upload"].method
    s = plane.hello()
    try:
        s.sendall(frames.pack(frames.CALL, method, 1, 0, len(hb), header.weight_bytes) + hb)
        s.sendall(bytes(header.weight_bytes // 2))
    finally:
        s.close()
    plane.connections_drain(base)
    plane.healthy()
    plane.check()  # nothing stored, no budget held
    assert plane.failures.upload_closed == [], plane.failures.upload_closed[0]


def test_a_frame_stalled_in_its_middle_is_closed_after_the_stall_timeout():
    # A CALL header and half its body, then nothing: the connection is closed after
    # --data-stall-timeout while another connection keeps being served.
    srv = serve(data_stall_timeout=0.5)
    try:
        port = srv.data.port
        stalled = socket.create_connection(("127.0.0.1", port), HANG_S)
        stalled.sendall(hello_frame())
        head, body, _ = read_frame(stalled)
        assert head.type == frames.WELCOME and head.status == 0, body
        body = pb.InfoRequest().SerializeToString() + bytes(64)
        stalled.sendall(frames.pack(frames.CALL, INFO, 1, 0, len(body), 0) + body[:10])
        other = socket.create_connection(("127.0.0.1", port), HANG_S)
        other.sendall(hello_frame())
        assert read_frame(other)[0].status == 0
        other.sendall(call_bytes(INFO, 7, pb.InfoRequest()))
        head, _, _ = read_frame(other)
        assert head.type == frames.REPLY and head.status == 0 and head.request_id == 7
        assert closed_by_worker(stalled)
        other.sendall(call_bytes(INFO, 8, pb.InfoRequest()))  # the other still served
        assert read_frame(other)[0].request_id == 8
        stalled.close()
        other.close()
    finally:
        srv.stop(grace=None)


def test_frame_socket_stall_limits_only_the_middle_of_a_frame():
    a, b = socket.socketpair()
    try:
        fs = frames.FrameSocket(a, spin_us=0, stall_s=0.2)
        b.sendall(frames.pack(frames.CALL, INFO, 1, 0, 8, 0)[:5])  # 5 bytes of a header
        with pytest.raises(frames.Stalled, match="in the middle of a frame"):
            fs.recv_header()
        # Between frames a deadline, not the stall limit, bounds the wait.
        fs2 = frames.FrameSocket(b, spin_us=0, stall_s=0.05)
        with pytest.raises(TimeoutError) as info:
            fs2.recv_header(deadline=time.monotonic() + 0.3)
        assert not isinstance(info.value, frames.Stalled)
    finally:
        a.close()
        b.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout():
    srv = serve(data_idle_timeout=0.5)
    try:
        s = socket.create_connection(("127.0.0.1", srv.data.port), HANG_S)
        s.sendall(hello_frame())
        assert read_frame(s)[0].status == 0
        s.sendall(call_bytes(INFO, 1, pb.InfoRequest()))
        assert read_frame(s)[0].request_id == 1  # served, then idle
        assert closed_by_worker(s)
        s.close()
    finally:
        srv.stop(grace=None)
