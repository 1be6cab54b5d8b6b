"""The socket data plane: the same results and errors as unary gRPC for every call, every RPC
of the contract over frames, authentication (token, ticket), Unix socket, ordering of
ragged attention, and connection-level refusals that leave the worker serving."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from _hotpath import D, check_ragged_order, check_results_equal_unary

from coliworker.client import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    WorkerClient,
)
from coliworker.client.socket_session import SocketSession
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec, frames


@pytest.fixture
def session(client):
    with client.session(transport="socket") as s:
        assert s.transport == "socket"
        yield s


def test_results_equal_unary(client, model, session, rng):
    check_results_equal_unary(client, model, session, rng)


def test_ragged_order_on_one_kv_b(client, model, session, rng):
    check_ragged_order(client, model, session, rng)


def test_error_fails_alone_and_connection_goes_on(model, session, rng):
    x = rng.standard_normal((2, D)).astype(np.float32)
    good1 = session.matmul(model.mat, x)
    unknown = session.matmul(987654321, x)
    wrong_cols = session.matmul(model.mat, x[:, :-1])
    good2 = session.matmul(model.mat, x)
    with pytest.raises(NotFound, match="matmul.handle"):
        unknown.result()
    with pytest.raises(InvalidArgument, match="matmul.x"):
        wrong_cols.result()
    np.testing.assert_array_equal(good1.result(), good2.result())
    np.testing.assert_array_equal(session.matmul_sync(model.mat, x), good1.result())


def test_threads_share_a_connection(client, model, session, rng):
    xs = [rng.standard_normal((1, D)).astype(np.float32) for _ in range(8)]
    want = [client.matmul(model.mat, x) for x in xs]
    got: list = [None] * len(xs)

    def run(i: int) -> None:
        for _ in range(5):
            got[i] = session.matmul_sync(model.mat, xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _raw(server, spin_us: int = 0) -> frames.FrameSocket:
    sock = socket.create_connection(("127.0.0.1", server.data.port), 5)
    return frames.FrameSocket(sock, spin_us)


def _hello(fs: frames.FrameSocket, **fields) -> frames.Header:
    body = pb.DataHello(version=1, **fields).SerializeToString()
    fs.send(frames.frame(frames.HELLO, 0, 0, body))
    head = fs.recv_header()
    fs.recv_bytes(head.body_bytes)
    return head


def _call(fs: frames.FrameSocket, kind: str, request, rid: int = 1, side=(), data=None):
    c = calls.BY_KIND[kind]
    pieces, n = frames.place(request, list(side)) if side else ([], 0)
    if data is not None:
        pieces, n = [data], len(data)
    fs.send(frames.frame(frames.CALL, c.method, rid, request.SerializeToString(), pieces, n))
    head = fs.recv_header()
    body = bytes(fs.recv_bytes(head.body_bytes))
    out = fs.recv_array(head.data_bytes)
    assert head.request_id == rid and head.method == c.method
    if head.status:
        return head.status, body.decode()
    return 0, (c.response.FromString(body), out)


def test_every_rpc_travels_on_the_data_plane(server, client, rng):
    """Info, Lookup, Upload (one frame with the bytes), Update, Stats, issue/take, ragged
    attention, FreeSequence, Free, DataTicket: answered as over gRPC."""
    fs = _raw(server)
    try:
        assert _hello(fs).status == 0
        code, (info, _) = _call(fs, "info", pb.InfoRequest())
        assert code == 0 and info.instance_id == client.info().instance_id
        assert info.data_port == server.data.port
        weights = rng.standard_normal((8, D)).astype(np.float32)
        wb = weights.tobytes()
        digest = codec.content_hash(0, D, 8, 0, wb, b"")
        header = pb.UploadHeader(
            spec=pb.TensorSpec(fmt=0, in_features=D, out_features=8),
            content_hash=digest,
            weight_bytes=len(wb),
        )
        code, (up, _) = _call(fs, "upload", header, data=wb)
        assert code == 0 and not up.deduplicated
        h = up.tensor.handle
        code, (look, _) = _call(fs, "lookup", pb.LookupRequest(content_hash=digest))
        assert code == 0 and look.found
        x = rng.standard_normal((3, D)).astype(np.float32)
        side: list = []
        req = pb.MatmulRequest(handle=h, x=codec.encode(x, pb.DTYPE_FLOAT32, side))
        code, (mm, data) = _call(fs, "matmul", req, side=side)
        y = codec.decode(mm.y, "y", source=lambda a: data[a.staged.offset :][: a.staged.length])
        np.testing.assert_array_equal(y, client.matmul(h, x))
        new = -weights
        nb = new.tobytes()
        header2 = pb.UploadHeader(
            spec=header.spec,
            content_hash=codec.content_hash(0, D, 8, 0, nb, b""),
            weight_bytes=len(nb),
            handle=h,
        )
        assert _call(fs, "update", header2, data=nb)[0] == 0
        np.testing.assert_array_equal(client.matmul(h, x), -y)
        code, (stats, _) = _call(fs, "stats", pb.StatsRequest())
        assert code == 0 and stats.devices[0].tensors >= 1
        code, (ticket, _) = _call(fs, "data_ticket", pb.DataTicketRequest())
        assert code == 0 and len(ticket.ticket) == 32
        code, (freed, _) = _call(fs, "free", pb.FreeRequest(handle=h))
        assert code == 0
        code, msg = _call(fs, "free", pb.FreeRequest(handle=h))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "free.handle" in msg
        code, (fseq, _) = _call(fs, "free_sequence", pb.FreeSequenceRequest(sequence_id=424242))
        assert code == 0 and fseq.caches == 0
    finally:
        fs.close()


def test_refused_upload_keeps_the_connection_in_step(server, rng):
    """An upload whose hash does not match its bytes is refused; the connection reads past
    its data and answers the next call."""
    fs = _raw(server)
    try:
        _hello(fs)
        wb = rng.standard_normal((4, D)).astype(np.float32).tobytes()
        header = pb.UploadHeader(
            spec=pb.TensorSpec(fmt=0, in_features=D, out_features=4),
            content_hash=bytes(32),
            weight_bytes=len(wb),
        )
        code, msg = _call(fs, "upload", header, data=wb)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "content_hash" in msg
        header.weight_bytes = 7
        code, msg = _call(fs, "upload", header, data=wb[:7])
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "weight_bytes" in msg
        assert _call(fs, "info", pb.InfoRequest())[0] == 0
    finally:
        fs.close()


@pytest.mark.parametrize(
    "bad, code, text",
    [
        (lambda: frames.HEADER.pack(b"XXXX", 3, 0, 1, 1, 0, 0, 0), 3, "frame.magic"),
        (lambda: frames.HEADER.pack(frames.MAGIC, 9, 0, 1, 2, 0, 0, 0), 3, "frame.type"),
        (lambda: frames.HEADER.pack(frames.MAGIC, 3, 1, 1, 3, 0, 0, 0), 3, "frame.flags"),
        (lambda: frames.pack(frames.CALL, 16, 4, 0, 0, 0), 3, "frame.method"),
        (lambda: frames.pack(frames.CALL, 99, 5, 0, 0, 0), 3, "frame.method"),
        (lambda: frames.pack(frames.CALL, 7, 6, 0, 8 << 20, 0), 8, "body_bytes"),
        (lambda: frames.pack(frames.CALL, 7, 7, 0, 10, 1 << 40), 8, "max-frame-bytes"),
        (lambda: frames.pack(frames.REPLY, 7, 8, 0, 0, 0), 3, "frame.type"),
    ],
)
def test_broken_frames_end_only_their_connection(server, client, model, rng, bad, code, text):
    fs = _raw(server)
    try:
        _hello(fs)
        fs.send([bad()])
        head = fs.recv_header()
        msg = bytes(fs.recv_bytes(head.body_bytes)).decode()
        assert head.status == code and text in msg
        with pytest.raises(frames.Closed):
            fs.recv_header()
    finally:
        fs.close()
    x = rng.standard_normal((1, D)).astype(np.float32)
    with client.session(transport="socket") as s:  # the worker serves on
        np.testing.assert_array_equal(s.matmul_sync(model.mat, x), client.matmul(model.mat, x))


def test_bad_body_and_bad_slice_are_ordinary_errors(server, model, rng):
    fs = _raw(server)
    try:
        _hello(fs)
        fs.send(frames.frame(frames.CALL, 7, 1, b"\xff\xff\xff"))
        head = fs.recv_header()
        assert head.status == 3 and b"not a MatmulRequest" in bytes(fs.recv_bytes(head.body_bytes))
        ghost = pb.Array(dtype=1, shape=[1, D], staged=pb.Slice(offset=0, length=4 * D))
        code, msg = _call(fs, "matmul", pb.MatmulRequest(handle=model.mat.handle, x=ghost), rid=2)
        assert code == 3 and "staged slice" in msg
        assert _call(fs, "info", pb.InfoRequest(), rid=3)[0] == 0
    finally:
        fs.close()


def test_hello_first_and_bounded(server):
    fs = _raw(server)
    try:
        fs.send([frames.pack(frames.CALL, 1, 1, 0, 0, 0)])  # a call before the HELLO
        head = fs.recv_header()
        assert head.type == frames.WELCOME and head.status == 3
        fs.recv_bytes(head.body_bytes)
        with pytest.raises(frames.Closed):
            fs.recv_header()
    finally:
        fs.close()
    fs = _raw(server)
    try:
        fs.send([frames.pack(frames.HELLO, 0, 0, 0, 1 << 20, 0)])  # an oversized HELLO
        head = fs.recv_header()
        assert head.type == frames.WELCOME and head.status == 3
    finally:
        fs.close()


TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "data.sock")
    tokens = ",".join(f"{k}:{v}" for k, v in TOKENS.items())
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, tokens=tokens, data_unix_socket=path)
    ).start()
    yield srv
    srv.stop(0)


def test_data_plane_needs_a_token_or_ticket(secured, rng):
    fs = _raw(secured)
    try:
        head = _hello(fs)
        assert head.type == frames.WELCOME and head.status == 16
    finally:
        fs.close()
    fs = _raw(secured)
    try:
        assert _hello(fs, token="wrong-token-0123456789").status == 16
    finally:
        fs.close()
    with WorkerClient(secured.address, token=TOKENS["alice"]) as w:
        ticket = w._stub.DataTicket(pb.DataTicketRequest()).ticket
    fs = _raw(secured)
    try:
        assert _hello(fs, ticket=ticket).status == 0
    finally:
        fs.close()
    fs = _raw(secured)
    try:
        assert _hello(fs, ticket=ticket).status == 16  # used up
    finally:
        fs.close()


def test_owners_stay_apart_on_the_data_plane(secured, rng):
    """bob's connection cannot use alice's handle; each owner's socket session works."""
    w = rng.standard_normal((4, D)).astype(np.float32)
    x = rng.standard_normal((1, D)).astype(np.float32)
    with (
        WorkerClient(secured.address, token=TOKENS["alice"]) as a,
        WorkerClient(secured.address, token=TOKENS["bob"]) as b,
    ):
        t = a.upload(w, None, fmt=0, in_features=D, out_features=4)
        with a.session(transport="socket") as sa, b.session(transport="socket") as sb:
            np.testing.assert_array_equal(sa.matmul_sync(t, x), a.matmul(t, x))
            with pytest.raises(NotFound):
                sb.matmul_sync(t.handle, x)


def test_unix_socket_is_preferred_on_this_host(secured, rng):
    with WorkerClient(secured.address, token=TOKENS["alice"]) as w:
        with w.session(transport="socket") as s:
            assert s.address.startswith("unix:")
            w8 = rng.standard_normal((4, D)).astype(np.float32)
            t = w.upload(w8, None, fmt=0, in_features=D, out_features=4)
            x = rng.standard_normal((2, D)).astype(np.float32)
            np.testing.assert_array_equal(s.matmul_sync(t, x), w.matmul(t, x))


def test_wrong_token_raises_unauthenticated(secured):
    with WorkerClient(secured.address, token="nobody-token-0123456789") as w:
        with pytest.raises(Unauthenticated):
            SocketSession(w)


def test_off_means_no_data_plane(rng):
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None, data_port=None))
    srv.start()
    try:
        assert srv.data.listeners == [] and srv.servicer.data_endpoint[0] == 0
        with WorkerClient(srv.address) as w:
            assert w.session(transport="auto", shm_bytes=1 << 20).transport in ("shm", "grpc")
    finally:
        srv.stop(0)


def test_one_owner_cannot_take_every_connection(rng):
    """An owner gets at most half of --max-data-connections; another still connects."""
    tokens = ",".join(f"{k}:{v}" for k, v in TOKENS.items())
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, tokens=tokens, max_data_connections=4)
    ).start()
    held = []
    try:
        for _ in range(2):
            fs = _raw(srv)
            held.append(fs)
            assert _hello(fs, token=TOKENS["alice"]).status == 0
        fs = _raw(srv)
        held.append(fs)
        head = frames.FrameSocket.recv_header  # the third of alice's is refused, typed
        body = pb.DataHello(version=1, token=TOKENS["alice"]).SerializeToString()
        fs.send(frames.frame(frames.HELLO, 0, 0, body))
        h = head(fs)
        assert h.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert b"max-data-connections" in bytes(fs.recv_bytes(h.body_bytes))
        bob = _raw(srv)
        held.append(bob)
        assert _hello(bob, token=TOKENS["bob"]).status == 0
    finally:
        for fs in held:
            fs.close()
        srv.stop(0)


def test_large_frames_are_admitted_against_the_owner(rng):
    """A data-plane call's frame is host memory its owner holds while it runs: past
    --max-staged-bytes-per-owner it is refused, typed, and the connection goes on."""
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, max_staged_bytes_per_owner=2 << 20)
    ).start()
    try:
        with WorkerClient(srv.address) as w, w.session(transport="socket") as s:
            t = w.upload(np.eye(64, dtype=np.float32), None, fmt=0, in_features=64, out_features=64)
            small = rng.standard_normal((4096, 64)).astype(np.float32)  # 1 MiB: admitted
            np.testing.assert_array_equal(s.matmul_sync(t, small), w.matmul(t, small))
            big = rng.standard_normal((16384, 64)).astype(np.float32)  # 4 MiB: over the share
            with pytest.raises(ResourceExhausted, match="max-staged-bytes-per-owner"):
                s.matmul_sync(t, big)
            np.testing.assert_array_equal(s.matmul_sync(t, small), w.matmul(t, small))
            # the worker gives the frame's bytes back after its reply is on the wire, so the
            # caller can see the reply a moment before the count drops
            deadline = time.monotonic() + 10
            while srv.servicer.owners.held("")[2] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.servicer.owners.held("")[2] == 0
    finally:
        srv.stop(0)


def test_a_session_dials_again_when_the_worker_closed_its_idle_connection(rng, monkeypatch):
    """--data-idle-timeout closes the connection between calls; the session's next call finds
    it closed, connects again to the same worker and is served with the same handles."""
    from coliworker.client import socket_session

    monkeypatch.setattr(socket_session, "IDLE_CHECK_S", 0.2)
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, data_port=0, data_idle_timeout=0.3)
    ).start()
    try:
        with WorkerClient(srv.address, progress=False) as w:
            m = rng.standard_normal((7, 5)).astype(np.float32)
            t = w.upload(m, None, fmt=0, in_features=5, out_features=7)
            x = rng.standard_normal((2, 5)).astype(np.float32)
            want = w.matmul(t, x)
            with w.session(transport="socket") as s:
                assert np.array_equal(s.matmul_sync(t, x), want)
                first = s._io
                deadline = time.monotonic() + 10
                while srv.data.connections() and time.monotonic() < deadline:
                    time.sleep(0.05)  # the worker closes the idle connection
                assert not srv.data.connections()
                assert np.array_equal(s.matmul_sync(t, x), want)
                assert s._io is not first
    finally:
        srv.stop(0)
