"""The shared-memory data plane: both directions, private memfds, refusals, cleanup on
death/stop (the SIGBUS hardening of segments is in tests/reliability/test_shm_segments.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
from _hotpath import D, mapped, wait_for

from coliworker.client import FailedPrecondition, InvalidArgument, WorkerClient
from coliworker.client.session_calls import SessionFuture
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import shm as shm_mod
from coliworker.wire.shm import Segment, shm_dir


def test_round_trip_both_directions(client, model, rng, monkeypatch):
    calls = {"read": 0, "read_array": 0, "view": 0, "write": 0}
    read, read_array = Segment.read, Segment.read_array
    view, write = Segment.view, Segment.write

    def counting_read(self, *a):
        calls["read"] += 1
        return read(self, *a)

    def counting_read_array(self, *a):
        calls["read_array"] += 1
        return read_array(self, *a)

    def counting_view(self, *a):
        calls["view"] += 1
        return view(self, *a)

    def counting_write(self, *a):
        calls["write"] += 1
        return write(self, *a)

    monkeypatch.setattr(Segment, "read", counting_read)
    monkeypatch.setattr(Segment, "read_array", counting_read_array)
    monkeypatch.setattr(Segment, "view", counting_view)
    monkeypatch.setattr(Segment, "write", counting_write)
    x = rng.standard_normal((3, D)).astype(np.float32)
    with client.session(shm=True) as s:
        y = s.matmul_sync(model.mat, x)
    np.testing.assert_array_equal(y, client.matmul(model.mat, x))
    # client writes x, worker reads it in place (a view: no copy); worker writes y, client
    # reads it (a copy: the region is reused by later calls)
    assert calls == {"read": 0, "read_array": 1, "view": 1, "write": 2}


def test_segment_is_private_and_unlinked(client, server):
    with client.session(shm=True) as s:
        seg = s.segment
        assert os.fstat(seg.fd).st_mode & 0o777 == 0o600
        assert seg.name.startswith(f"coliworker-{os.getpid()}-")
        assert not os.path.exists(os.path.join(shm_dir(), seg.name))  # unlinked once attached
        assert server.servicer.sessions.attached_segments() == [seg.name]
        assert mapped(seg.name)
    assert wait_for(lambda: not mapped(seg.name))
    assert wait_for(lambda: server.servicer.sessions.attached_segments() == [])


def test_worker_refuses_a_named_segment_and_an_unknown_ticket(client):
    """The by-name protocol (a file in /dev/shm, which its client could truncate) is refused;
    a ticket no attach_shm gave out attaches nothing; the proper steps then work."""
    seg = Segment.create(1 << 16)
    try:
        with client.session(transport="grpc") as s:
            for name in ("coliworker-1-0123456789abcdef", "../etc/passwd"):
                msg = pb.ShmAttach(name=name, size=1 << 16, nonce=b"\0" * 16)
                with pytest.raises(FailedPrecondition, match="attach_shm.name: expected empty"):
                    s._submit("attach_shm", msg, None).result(10)
            t = s._submit("attach_shm", pb.ShmAttach(size=seg.size), None).result(10)
            code, message = shm_mod.pass_fd(t.socket, b"\1" * 16, seg.fd)
            assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert "no attach_shm of this worker gave it out" in message
            s._attach_segment(seg)  # the ticket above is still good: now fine
            assert s._client is client
    finally:
        seg.close()


def test_worker_on_another_host_is_failed_precondition(monkeypatch):
    """The attach socket the worker names does not exist here: FailedPrecondition (which
    transport="auto" takes as "another host" and falls back), before any memory is made."""
    made: list[int] = []
    monkeypatch.setattr(Segment, "create", classmethod(lambda cls, size: made.append(size)))
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None, data_port=0)).start()
    try:
        shutil.rmtree(srv.servicer.sessions.attach_socket.dir)  # as seen from another host
        with WorkerClient(srv.address, timeout=10) as w:
            with pytest.raises(FailedPrecondition, match="another host"):
                w.session(shm=True)
            with w.session() as s:  # "auto": the socket data plane instead
                assert s.transport == "socket"
        assert made == []
    finally:
        srv.stop(0)


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from coliworker.client import WorkerClient
    w = WorkerClient(sys.argv[1])
    s = w.session(shm=True)
    print(s.segment.name, flush=True)
    time.sleep(600)
    """
)


def test_dead_client_leaks_nothing(server):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, server.address], stdout=subprocess.PIPE, text=True
    )
    try:
        name = child.stdout.readline().strip()
        assert name.startswith(f"coliworker-{child.pid}-")
        assert wait_for(lambda: name in server.servicer.sessions.attached_segments())
        assert mapped(name)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_for(lambda: name not in server.servicer.sessions.attached_segments())
        assert wait_for(lambda: not mapped(name))
        assert not os.path.exists(os.path.join(shm_dir(), name))
    finally:
        child.kill()
        child.stdout.close()


def test_stale_segment_of_dead_process_is_swept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = os.path.join(shm_dir(), f"coliworker-{dead.pid}-0123456789abcdef")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    seg = Segment.create(1 << 12)
    try:
        assert not os.path.exists(path)
    finally:
        seg.close()
    assert not os.path.exists(os.path.join(shm_dir(), seg.name))  # a memfd: never named


def test_worker_stop_releases_segment(rng):
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    w = WorkerClient(srv.address, timeout=10)
    s = w.session(shm=True)
    name = s.segment.name
    assert mapped(name)
    srv.stop(0)
    assert wait_for(lambda: srv.servicer.sessions.attached_segments() == [])
    with pytest.raises(Exception):  # noqa: B017 - Unavailable or Cancelled, by timing
        s.matmul(1, rng.standard_normal((1, D)).astype(np.float32)).result(10)
    s.close()
    w.close()
    assert wait_for(lambda: not mapped(name))
    assert not [n for n in os.listdir(shm_dir()) if n.startswith(f"coliworker-{os.getpid()}-")]


def test_allocator_reuses_and_coalesces():
    a = shm_mod.Allocator(shm_mod.HEADER_BYTES + 1024)
    blocks = [a.alloc(100) for _ in range(8)]
    assert None not in blocks and a.alloc(64) is None
    for off in blocks[::2] + blocks[1::2]:
        a.free(off, 100)
    assert a.free_bytes() == 1024 and a.alloc(1024) == shm_mod.HEADER_BYTES


def test_output_region_is_checked_before_the_call_runs(client, server, model, rng, monkeypatch):
    """An output_shm outside the segment (or with none attached) is INVALID_ARGUMENT naming
    the field, and the compute never runs."""
    ran = []
    matmul = server.servicer.matmul
    monkeypatch.setattr(server.servicer, "matmul", lambda *a: ran.append(1) or matmul(*a))
    x = rng.standard_normal((1, D)).astype(np.float32)
    req = pb.SessionRequest(
        request_id=3,
        matmul=pb.MatmulRequest(
            handle=model.mat.handle,
            x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[1, D], data=x.tobytes()),
        ),
        output_shm=pb.Slice(offset=1 << 40, length=4 * D),
    )
    (resp,) = list(client._stub.Session(iter([req])))  # no segment attached
    assert resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "output_shm" in resp.error.message
    with client.session(shm=True) as s:
        s.matmul_sync(model.mat, x)  # a good call first: the segment is attached
        ran.clear()
        body = pb.MatmulRequest(
            handle=model.mat.handle,
            x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[1, D], data=x.tobytes()),
        )
        rid = 99
        fut = SessionFuture(rid)
        s._pending[rid] = (fut, lambda b, f, src: b)
        bad = pb.SessionRequest(request_id=rid, matmul=body)
        bad.output_shm.offset, bad.output_shm.length = s.segment.size, 4 * D
        s._send.put([bad])
        with pytest.raises(InvalidArgument, match="matmul.output_shm"):
            fut.result(10)
        assert ran == []
