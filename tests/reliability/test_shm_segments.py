"""Shared memory never kills the worker (issue 16 item 1): segments are sealed, fully
allocated memfds passed over the worker's attach socket (``coliworker.wire.shm``,
``server/shm_socket.py``). A segment that would let its client SIGBUS the worker is refused
with a typed status naming the field and both values, and the worker goes on serving every
client and owner. The kernel-level attacks run against a subprocess worker, so a SIGBUS
would fail the test instead of killing pytest."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
import time

import grpc
import numpy as np
import pytest
from _rel import TOKENS, TOL, random_tensor, rel_err, serve, token_env, upload

from coliworker.client import ResourceExhausted, WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server import shm_socket
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import shm
from coliworker.wire.shm import Segment, ShmError

CODE = {c.value[0]: c for c in grpc.StatusCode}
SIZE = 1 << 20


def memfd(size: int, *, allocate: bool = True, seals: int = shm.SEALS) -> int:
    fd = os.memfd_create("coliworker-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def ticket(s, size: int = SIZE) -> pb.ShmTicket:
    return s._submit("attach_shm", pb.ShmAttach(size=size), None).result(20)


def pass_segment(s, fd: int, size: int = SIZE) -> tuple[grpc.StatusCode, str]:
    """Steps 2-3 by hand: a ticket on the stream, then ``fd`` over the attach socket."""
    t = ticket(s, size)
    code, message = shm.pass_fd(t.socket, t.ticket, fd)
    return CODE[code], message


def check_calls(w: WorkerClient, rng, transport: str = "shm") -> None:
    """``w`` still gets right answers, on a fresh session of ``transport``."""
    t = random_tensor(rng, 0, 64, 32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    h = upload(w, t)
    with w.session(transport=transport) as s:
        assert s.transport == transport
        assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
    w.free(h)


def client(srv, who: str) -> WorkerClient:
    return WorkerClient(srv.address, timeout=20, progress=False, token=TOKENS[who])


@pytest.fixture
def owners():
    srv = serve(tokens=token_env())
    try:
        yield srv
    finally:
        srv.stop(grace=None)


# -- against a subprocess worker: what would have been SIGBUS -------------------------------


def test_truncating_after_attach_is_refused_by_the_kernel_and_the_worker_serves(worker, rng):
    t = random_tensor(rng, 0, 64, 32)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    with WorkerClient(worker.address, timeout=20, progress=False) as w:
        h = upload(w, t)
        with w.session(transport="shm") as s:
            assert s.transport == "shm"
            assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
            fd, size = s.segment.fd, s.segment.size
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & shm.SEALS == shm.SEALS
            with pytest.raises(PermissionError) as e:  # the attack of issue 16
                os.ftruncate(fd, 4096)
            assert e.value.errno == errno.EPERM
            with pytest.raises(PermissionError):  # nor by reopening it through /proc
                os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_TRUNC)
            with pytest.raises(PermissionError):  # and the seals cannot be taken back
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(fd).st_size == size
            for _ in range(3):  # every array through the segment, answered right
                assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
        assert worker.proc.poll() is None
        check_calls(w, rng)
        check_calls(w, rng, "grpc")


def test_an_unsealed_segment_is_refused_so_truncating_it_hurts_nobody(worker, rng):
    with WorkerClient(worker.address, timeout=20, progress=False) as w:
        with w.session(transport="grpc") as s:
            for seals in (0, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):  # unsealed / no SHRINK
                fd = memfd(SIZE, seals=seals)
                try:
                    code, message = pass_segment(s, fd)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
                    assert "not sealed against shrinking" in message
                    assert f"got {seals:#x}" in message
                    os.ftruncate(fd, 4096)  # allowed now, and nothing of the worker maps it
                finally:
                    os.close(fd)
            sparse = memfd(SIZE, allocate=False)  # sealed, but holes (a full tmpfs: SIGBUS)
            try:
                code, message = pass_segment(s, sparse)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert f"expected all of its {SIZE} bytes allocated, got 0" in message
            finally:
                os.close(sparse)
        assert worker.proc.poll() is None
        check_calls(w, rng)


# -- in process: each refusal typed, and everyone else served --------------------------------


def test_files_that_are_not_sealed_allocated_memfds_are_refused(owners, rng, tmp_path):
    a, b = client(owners, "alice"), client(owners, "bob")
    devshm = os.path.join(shm.shm_dir(), f"coliworker-test-{os.getpid()}")
    fds = {
        "unsealed memfd": memfd(SIZE, seals=0),
        "file in /dev/shm": os.open(devshm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600),
        "file on disk": os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600),
        "pipe": os.pipe()[0],
        "small memfd": memfd(SIZE // 2),
        "sparse memfd": memfd(SIZE, allocate=False),
        "read-only memfd": memfd(SIZE, seals=shm.SEALS | shm.F_SEAL_WRITE),
    }
    os.unlink(devshm)
    for name in ("file in /dev/shm", "file on disk"):
        os.ftruncate(fds[name], SIZE)
        os.posix_fallocate(fds[name], 0, SIZE)
    disk_on_tmpfs = shm.fs_type(fds["file on disk"]) == shm.TMPFS_MAGIC
    want = {
        "unsealed memfd": "not sealed against shrinking: expected F_SEAL_SHRINK (0x2) in its "
        "seals, got 0x0",
        "file in /dev/shm": "not sealed against shrinking",  # tmpfs files take no seals
        "file on disk": "not sealed" if disk_on_tmpfs else f"f_type {shm.TMPFS_MAGIC:#010x}",
        "pipe": "expected a memfd (a regular file)",
        "small memfd": f"attach_shm.size: expected <= {SIZE // 2}",
        "sparse memfd": f"expected all of its {SIZE} bytes allocated, got 0",
        "read-only memfd": "sealed against writing: expected neither F_SEAL_WRITE (0x8) nor "
        "F_SEAL_FUTURE_WRITE (0x10) in its seals, got 0xf",
    }
    try:
        with a.session(transport="grpc") as s:
            for name, fd in fds.items():
                code, message = pass_segment(s, fd)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, message)
                assert want[name] in message, (name, message)
                assert owners.servicer.sessions.attached_segments() == []
                check_calls(b, rng)  # another owner, on shared memory
            with pytest.raises(Exception, match=r"attach_shm.size: expected > 64, got 64"):
                ticket(s, 64)
            seg = Segment.create(SIZE)  # and the same stream still attaches a good one
            try:
                s._attach_segment(seg)
                assert owners.servicer.sessions.attached_segments() == [seg.name]
            finally:
                seg.close()
        check_calls(a, rng)
    finally:
        for fd in fds.values():
            os.close(fd)
        a.close()
        b.close()


def test_worker_side_allocation_failure_is_resource_exhausted(owners, rng, monkeypatch):
    a, b = client(owners, "alice"), client(owners, "bob")
    try:
        with a.session(transport="grpc") as s:
            seg = Segment.create(SIZE)  # the client's own allocation succeeded
            try:

                def full(fd, offset, length):  # a full tmpfs / memory cgroup, in the worker
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                monkeypatch.setattr(os, "posix_fallocate", full)
                with pytest.raises(ResourceExhausted) as e:
                    s._attach_segment(seg)
                monkeypatch.undo()
                msg = e.value.message
                assert f"segment {seg.name}" in msg and f"its {seg.size} bytes" in msg
                held = os.fstat(seg.fd).st_blocks * 512  # whole pages
                assert f"{held} bytes allocated" in msg and "No space left" in msg
                assert owners.servicer.sessions.attached_segments() == []
                check_calls(b, rng)
                s._attach_segment(seg)  # space again: the same segment attaches
                assert owners.servicer.sessions.attached_segments() == [seg.name]
            finally:
                seg.close()
        check_calls(a, rng)
    finally:
        a.close()
        b.close()


def test_client_side_allocation_failure_is_a_clear_error(owners, rng, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    a = client(owners, "alice")
    try:
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(ResourceExhausted, match=r"shm_bytes: cannot allocate .*No space"):
            a.session(transport="shm")
        monkeypatch.undo()
        assert owners.servicer.sessions.attached_segments() == []
        check_calls(a, rng)
    finally:
        a.close()


def test_tickets_are_one_time_and_belong_to_their_stream(owners, monkeypatch):
    a = client(owners, "alice")
    attach = owners.servicer.sessions.attach_socket
    seg = Segment.create(SIZE)
    try:
        with a.session(transport="grpc") as s:
            first = ticket(s)
            second = ticket(s)  # replaces the first
            assert attach.pending() == 1
            code, message = shm.pass_fd(first.socket, first.ticket, seg.fd)
            assert CODE[code] == grpc.StatusCode.FAILED_PRECONDITION
            assert "used, replaced or void" in message
            code, _ = shm.pass_fd(second.socket, second.ticket, seg.fd)
            assert CODE[code] == grpc.StatusCode.OK
            code, message = shm.pass_fd(second.socket, second.ticket, seg.fd)  # once only
            assert CODE[code] == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(Exception, match="already has segment"):
                ticket(s)
        with a.session(transport="grpc") as s:
            gone = ticket(s)
        assert attach.pending() == 0  # the stream ended: its ticket is void
        code, _ = shm.pass_fd(gone.socket, gone.ticket, seg.fd)
        assert CODE[code] == grpc.StatusCode.FAILED_PRECONDITION
        monkeypatch.setattr(shm_socket, "TICKET_TTL_S", 0.0)
        with a.session(transport="grpc") as s:
            late = ticket(s)
            code, message = shm.pass_fd(late.socket, late.ticket, seg.fd)
            assert CODE[code] == grpc.StatusCode.FAILED_PRECONDITION, message
    finally:
        seg.close()
        a.close()


def test_another_uid_is_out_of_reach(owners, rng, monkeypatch):
    attach = owners.servicer.sessions.attach_socket
    st = os.stat(attach.dir)  # other uids cannot even reach the socket
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert shm_socket.peer_credentials(left) == (os.getpid(), os.geteuid(), os.getegid())
    me, other = os.geteuid(), os.geteuid() + 1
    with pytest.raises(ShmError, match=rf"runs as uid {other}, expected the worker's uid {me}"):
        shm_socket.check_peer(other, 1)
    a = client(owners, "alice")
    seg = Segment.create(SIZE)
    try:
        with a.session(transport="grpc") as s:
            t = ticket(s)
            monkeypatch.setattr(shm, "worker_uid", lambda: other)  # the worker runs as another
            code, message = shm.pass_fd(t.socket, t.ticket, seg.fd)
            assert CODE[code] == grpc.StatusCode.PERMISSION_DENIED
            assert f"runs as uid {me}, expected the worker's uid {other}" in message
            with pytest.raises(ShmError) as e:  # a segment of another uid, the same way
                shm.check_fd(seg.fd, SIZE)
            assert e.value.kind == "permission"
            assert f"owned by uid {me}, expected the worker's uid {other}" in e.value.message
            monkeypatch.setattr(shm, "fs_type", lambda fd: shm.HUGETLBFS_MAGIC)
            monkeypatch.setattr(shm, "worker_uid", lambda: me)
            with pytest.raises(ShmError, match=r"got f_type 0x958458f6 \(hugetlbfs\)"):
                shm.check_fd(seg.fd, SIZE)  # huge pages can fail a refill: SIGBUS
            monkeypatch.undo()
            code, message = shm.pass_fd(t.socket, t.ticket, seg.fd)  # not spent by the refusal
            assert CODE[code] == grpc.StatusCode.OK, message
        check_calls(a, rng)
    finally:
        seg.close()
        a.close()


def test_a_stalled_peer_gives_the_attach_socket_back(owners, rng, monkeypatch):
    monkeypatch.setattr(shm_socket, "PASS_TIMEOUT_S", 0.5)
    path = owners.servicer.sessions.attach_socket.path
    answers: list[bytes] = []
    with socket.socket(socket.AF_UNIX) as stalled:
        stalled.settimeout(20)
        stalled.connect(path)  # and sends nothing
        reader = threading.Thread(target=lambda: answers.append(stalled.recv(4096)))
        reader.start()
        a = client(owners, "alice")
        try:
            check_calls(a, rng)  # attaches once the stalled connection is given up
        finally:
            a.close()
        reader.join(20)
    assert answers and answers[0][0] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert b"timed out" in answers[0]


def test_a_slow_segment_handshake_is_not_idle(rng):
    """--session-idle-timeout: a stream whose client holds a ticket and is still passing its
    segment is not idle (a loaded client may take longer than the timeout between the two);
    once attached, the stream's idle time starts again, and it ends when it is truly idle."""
    timeout = 0.5
    srv = serve(tokens=token_env(), session_idle_timeout=timeout)
    a = client(srv, "alice")
    seg = Segment.create(SIZE)
    try:
        with a.session(transport="grpc") as s:
            t = ticket(s)
            time.sleep(4 * timeout)  # the handshake's step 3 comes late
            code, message = shm.pass_fd(t.socket, t.ticket, seg.fd)
            assert CODE[code] == grpc.StatusCode.OK, message
            assert srv.servicer.sessions.attached_segments() == [seg.name]
            w = random_tensor(rng, 0, 64, 32)
            x = rng.standard_normal((3, 64)).astype(np.float32)
            h = upload(a, w)
            assert rel_err(s.matmul_sync(h, x), ref.matmul(w, x)) < TOL
            deadline = time.monotonic() + 30
            while srv.servicer.sessions.streams() and time.monotonic() < deadline:
                time.sleep(0.05)  # nothing more: now it is idle, and ends
            assert srv.servicer.sessions.streams() == 0
            assert srv.servicer.sessions.attached_segments() == []
    finally:
        seg.close()
        a.close()
        srv.stop(grace=None)
