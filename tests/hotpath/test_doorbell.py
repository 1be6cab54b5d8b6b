"""The doorbell channel: same results as unary, typed per-call errors, private FIFOs and
the worker's refusals, cleanup when either side dies, order of ragged attention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
from _hotpath import D, check_ragged_order, check_results_equal_unary, mapped, wait_for

from coliworker.client import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    WorkerClient,
)
from coliworker.client import doorbell as bell
from coliworker.kernels import reference as ref
from coliworker.server import doorbell as server_bell
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire.shm import shm_dir


def _ours(pid: int) -> list[str]:
    return [n for n in os.listdir(shm_dir()) if n.startswith(f"coliworker-{pid}-")]


@pytest.fixture
def session(client):
    with client.session(shm=True, doorbell=True) as s:
        assert s.doorbell and s.shm
        yield s


def test_results_equal_unary(client, model, session, rng):
    check_results_equal_unary(client, model, session, rng)


def test_error_fails_alone_and_channel_goes_on(model, session, rng):
    x = rng.standard_normal((2, D)).astype(np.float32)
    good1 = session.matmul(model.mat, x)
    unknown = session.matmul(987654321, x)
    wrong_cols = session.matmul(model.mat, x[:, :-1])
    bad_route = session.expert_group_routed(
        model.experts, x, np.array([[0], [99]], np.int32), np.ones((2, 1), np.float32)
    )
    good2 = session.matmul(model.mat, x)  # five calls: more than the ring's slots
    with pytest.raises(NotFound, match="matmul.handle"):
        unknown.result(10)
    with pytest.raises(InvalidArgument, match=f"matmul.x: expected {D} columns"):
        wrong_cols.result(10)
    with pytest.raises(InvalidArgument, match=r"routes\[1, 0\]"):
        bad_route.result(10)
    np.testing.assert_array_equal(good1.result(10), good2.result(10))
    np.testing.assert_array_equal(session.matmul_sync(model.mat, x), good1.result())
    # every array stays in the segment: one that does not fit is refused before it is sent
    free = session._alloc.free_bytes()
    with pytest.raises(ResourceExhausted, match="shm_bytes"):
        session.matmul(model.mat, np.ones((free // (4 * D) + 1, D), np.float32))
    assert session._alloc.free_bytes() == free
    np.testing.assert_array_equal(session.matmul_sync(model.mat, x), good1.result())


def test_threads_share_a_channel(model, session, rng):
    """Several threads submit and wait on one channel: whoever waits reads the answers."""
    xs = [rng.standard_normal((1 + i % 3, D)).astype(np.float32) for i in range(60)]
    out: dict[int, np.ndarray] = {}

    def work(k: int) -> None:
        for i in range(k, len(xs), 4):
            out[i] = session.matmul_sync(model.mat, xs[i])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, x in enumerate(xs):
        np.testing.assert_allclose(out[i], ref.matmul(model.mat_t, x), rtol=1e-5, atol=1e-5)


def test_ragged_order_on_one_kv_b(client, model, session, rng):
    """Appends to one sequence submitted back to back (no waiting) run in order."""
    check_ragged_order(client, model, session, rng)


def test_calls_are_recorded(server, model, session, rng, monkeypatch):
    seen = []
    hooks = server.servicer.hooks
    monkeypatch.setattr(hooks, "record_session_request", lambda *a: seen.append(a))
    x = rng.standard_normal((1, D)).astype(np.float32)
    session.matmul_sync(model.mat, x)
    with pytest.raises(NotFound):
        session.matmul_sync(987654321, x)
    assert [(c, code) for c, code, _, _ in seen] == [
        ("matmul", grpc.StatusCode.OK),
        ("matmul", grpc.StatusCode.NOT_FOUND),
    ]
    assert all(sec > 0 for _, _, sec, _ in seen)
    assert {t for *_, t in seen} == {"shm"}


def test_fifos_are_private_and_removed(client, server):
    with client.session(shm=True) as s:
        off = s._alloc.alloc(2 * bell.SLOTS * bell.SLOT_BYTES)
        ch = bell.Channel.create(s.segment, off)
        try:
            assert os.lstat(ch.path).st_mode & 0o777 == 0o700
            for name in (bell.REQUEST, bell.RESPONSE):
                st = os.lstat(os.path.join(ch.path, name))
                assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        finally:
            ch.close(0)
        assert not os.path.exists(os.path.join(shm_dir(), ch.name))
    with client.session(shm=True, doorbell=True) as s:
        name = s._bell.name
        assert name.startswith(f"coliworker-{os.getpid()}-") and name.endswith(".bell")
        assert not os.path.exists(os.path.join(shm_dir(), name))  # removed once connected
        assert [t.name for t in server.servicer.sessions.doorbell_threads()] == [f"doorbell-{name}"]
    assert wait_for(lambda: server.servicer.sessions.doorbell_threads() == [])
    assert not _ours(os.getpid())


def _attach(s, ch):
    return s._submit("attach_doorbell", ch.attach_message(), None).result(10)


def test_worker_refuses_foreign_or_open_fifos(client, monkeypatch):
    with client.session(shm=True) as s:
        off = s._alloc.alloc(2 * bell.SLOTS * bell.SLOT_BYTES)
        ch = bell.Channel.create(s.segment, off)
        req = os.path.join(ch.path, bell.REQUEST)
        try:
            os.chmod(req, 0o620)
            with pytest.raises(PermissionDenied, match="request has mode 0620, expected 0600"):
                _attach(s, ch)
            os.chmod(req, 0o600)
            os.chmod(ch.path, 0o755)
            with pytest.raises(PermissionDenied, match="mode 0755, expected 0700"):
                _attach(s, ch)
            os.chmod(ch.path, 0o700)
            if os.geteuid() == 0:
                os.chown(req, 65534, 65534)
            else:  # only root can give a file away: make the worker expect another uid
                monkeypatch.setattr(server_bell, "_uid", lambda: os.geteuid() + 1)
            with pytest.raises(PermissionDenied, match="owned by uid"):
                _attach(s, ch)
            if os.geteuid() == 0:
                os.chown(req, 0, 0)
            monkeypatch.undo()
            os.unlink(req)
            os.symlink(os.path.join(ch.path, bell.RESPONSE), req)
            with pytest.raises(PermissionDenied, match="cannot open"):
                _attach(s, ch)
            os.unlink(req)
            os.mkfifo(req, 0o600)
            bad = ch.attach_message()
            bad.slots_offset = s.segment.size  # outside the segment
            with pytest.raises(InvalidArgument, match="attach_doorbell.slots_offset"):
                s._submit("attach_doorbell", bad, None).result(10)
            _attach(s, ch)  # now fine
            ch.connect()
        finally:
            ch.close(0)


def _missing() -> pb.DoorbellAttach:
    name = "coliworker-1-0123456789abcdef.bell"
    return pb.DoorbellAttach(directory=name, slots_offset=64, slots=4, slot_bytes=4096)


def test_worker_refuses_without_segment_or_directory(client):
    with (
        client.session(transport="grpc") as s,
        pytest.raises(FailedPrecondition, match="attach_shm"),
    ):
        msg = _missing()
        s._submit("attach_doorbell", msg, None).result(10)
    with client.session(shm=True) as s:
        msg = _missing()
        with pytest.raises(FailedPrecondition, match="another host"):
            s._submit("attach_doorbell", msg, None).result(10)
        msg.directory = "../etc"
        with pytest.raises(InvalidArgument, match="attach_doorbell.directory"):
            s._submit("attach_doorbell", msg, None).result(10)
    with pytest.raises(ValueError, match="shm=True"):
        client.session(doorbell=True)


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from coliworker.client import WorkerClient
    w = WorkerClient(sys.argv[1])
    s = w.session(shm=True, doorbell=True)
    x = np.ones((1, int(sys.argv[3])), np.float32)
    s.matmul_sync(int(sys.argv[2]), x)
    print(s.segment.name, s._bell.name, flush=True)
    while True:
        s.matmul_sync(int(sys.argv[2]), x)
    """
)


def test_killed_client_leaves_nothing(server, model):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, server.address, str(model.mat.handle), str(D)],
        stdout=subprocess.PIPE,
        text=True,
    )
    sessions = server.servicer.sessions
    try:
        seg, name = child.stdout.readline().split()
        assert wait_for(lambda: f"doorbell-{name}" in [t.name for t in sessions.doorbell_threads()])
        child.send_signal(signal.SIGKILL)  # mid-session, most likely mid-call
        child.wait(10)
        assert wait_for(
            lambda: f"doorbell-{name}" not in [t.name for t in sessions.doorbell_threads()]
        )
        # the stream leaves the session list before its channel thread has returned
        assert wait_for(
            lambda: not [t for t in threading.enumerate() if t.name == f"doorbell-{name}"]
        )
        assert wait_for(lambda: seg not in sessions.attached_segments())
        assert wait_for(lambda: not mapped(seg))
        assert not _ours(child.pid)
    finally:
        child.kill()
        child.stdout.close()


def test_worker_stop_fails_pending_call_with_unavailable(rng):
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    matmul = srv.servicer.matmul
    started = threading.Event()

    def slow(request, owner, io):
        started.set()
        time.sleep(0.5)
        return matmul(request, owner, io)

    srv.servicer.matmul = slow  # the stream looks its handlers up when it starts
    w = WorkerClient(srv.address, timeout=10)
    s = w.session(shm=True, doorbell=True)
    name = s._bell.name
    fut = s.matmul(1, rng.standard_normal((1, D)).astype(np.float32))
    assert started.wait(10)
    srv.stop(0)
    with pytest.raises(Unavailable):
        fut.result(10)
    with pytest.raises(Unavailable):
        s.matmul(1, rng.standard_normal((1, D)).astype(np.float32))
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == f"doorbell-{name}"])
    s.close()
    w.close()
    assert wait_for(lambda: not _ours(os.getpid()))


def test_a_call_on_a_doorbell_the_worker_closed_reports_the_streams_reason(rng, monkeypatch):
    """An idle session ends: the worker closes the doorbell and ends the stream with the
    reason. A call that finds the doorbell closed before the client has read the stream's
    end (held back here) still reports that reason, not a bare broken pipe: the channel
    waits, bounded, for the stream."""
    from coliworker.client import errors
    from coliworker.client import session as session_mod

    real = errors.from_rpc_error

    def late(exc):  # the reader sees the stream's end only after the call below is made
        time.sleep(0.5)
        return real(exc)

    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, session_idle_timeout=0.5)
    ).start()
    w = WorkerClient(srv.address, timeout=10)
    try:
        monkeypatch.setattr(session_mod.errors, "from_rpc_error", late)
        s = w.session(shm=True, doorbell=True)
        assert wait_for(lambda: srv.servicer.sessions.streams() == 0)
        with pytest.raises(Unavailable, match="session-idle-timeout"):
            s.matmul_sync(1, rng.standard_normal((1, D)).astype(np.float32))
        s.close()
    finally:
        w.close()
        srv.stop(0)
