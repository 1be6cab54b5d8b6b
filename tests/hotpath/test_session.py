"""The Session stream: same results as unary, several in flight, per-request errors,
arrival order for ragged attention on one kv_b."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from _hotpath import (
    D,
    check_ragged_order,
    check_results_equal_unary,
    routed_reference,
    routing,
    wait_for,
)

from coliworker.client import InvalidArgument, NotFound, WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb


@pytest.fixture(params=[False, True], ids=["stream", "shm"])
def session(client, request):
    with client.session(shm=request.param) as s:
        assert s.shm is request.param
        yield s


def test_results_equal_unary(client, model, session, rng):
    check_results_equal_unary(client, model, session, rng)


def test_routed_is_weighted_sum_of_expert_mlp(model, session, rng):
    x = rng.standard_normal((4, D)).astype(np.float32)
    routes, w = routing(rng, 4, 3, len(model.experts))
    y = session.expert_group_routed_sync(model.experts, x, routes, w)
    want = routed_reference(model, x, routes, w)
    assert np.max(np.abs(y - want)) <= 1e-5 * np.max(np.abs(want))


def test_several_in_flight(model, session, rng):
    xs = [rng.standard_normal((1 + i % 3, D)).astype(np.float32) for i in range(40)]
    futs = [session.matmul(model.mat, x) for x in xs]
    assert len({f.request_id for f in futs}) == len(futs)
    for x, f in zip(xs, futs, strict=True):
        np.testing.assert_allclose(f.result(10), ref.matmul(model.mat_t, x), rtol=1e-5, atol=1e-5)
        assert f.backend_ns > 0


def test_bad_request_fails_alone(model, session, rng):
    x = rng.standard_normal((2, D)).astype(np.float32)
    good1 = session.matmul(model.mat, x)
    unknown = session.matmul(987654321, x)
    wrong_cols = session.matmul(model.mat, x[:, :-1])
    bad_route = session.expert_group_routed(
        model.experts, x, np.array([[0], [99]], np.int32), np.ones((2, 1), np.float32)
    )
    good2 = session.matmul(model.mat, x)
    with pytest.raises(NotFound, match="matmul.handle"):
        unknown.result(10)
    with pytest.raises(InvalidArgument, match=f"matmul.x: expected {D} columns"):
        wrong_cols.result(10)
    with pytest.raises(InvalidArgument, match=r"routes\[1, 0\]"):
        bad_route.result(10)
    np.testing.assert_array_equal(good1.result(10), good2.result(10))
    # the stream is still usable
    np.testing.assert_array_equal(session.matmul_sync(model.mat, x), good1.result())


def test_requests_are_recorded(server, client, model, session, rng, monkeypatch):
    """Every request on the stream counts in the session metrics with its status: run ones
    (OK, NOT_FOUND) and one refused before it runs (a staged slice with no chunks)."""
    seen = []
    monkeypatch.setattr(server.servicer.hooks, "record_session_request", lambda *a: seen.append(a))
    x = rng.standard_normal((1, D)).astype(np.float32)
    session.matmul_sync(model.mat, x)
    with pytest.raises(NotFound):
        session.matmul_sync(987654321, x)
    ghost = pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[1, D], staged=pb.Slice(offset=0, length=4 * D))
    bad = pb.SessionRequest(request_id=7, matmul=pb.MatmulRequest(handle=model.mat.handle, x=ghost))
    (resp,) = list(client._stub.Session(iter([bad])))
    assert resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [(c, code) for c, code, _, _ in seen] == [
        ("matmul", grpc.StatusCode.OK),
        ("matmul", grpc.StatusCode.NOT_FOUND),
        ("matmul", grpc.StatusCode.INVALID_ARGUMENT),
    ]
    assert all(sec > 0 for _, _, sec, _ in seen)
    assert {t for *_, t in seen} == {"grpc"}


def test_ragged_order_on_one_kv_b(client, model, session, rng):
    """Appends to one sequence submitted back to back (no waiting) run in order."""
    check_ragged_order(client, model, session, rng)


def test_closed_session_refuses(model, client, rng):
    s = client.session(transport="grpc")
    s.close()
    with pytest.raises(Exception, match="closed"):
        s.matmul(model.mat, rng.standard_normal((1, D)).astype(np.float32))


def test_reading_moves_between_threads(model, session, rng):
    """Bursts (a reader thread reads) and one-at-a-time calls (the handler thread reads)
    alternate without losing, reordering or stalling a call."""
    for burst in (1, 12, 1, 1, 1, 1, 1, 1, 20, 1, 1):
        xs = [rng.standard_normal((2, D)).astype(np.float32) for _ in range(burst)]
        futs = [session.matmul(model.mat, x) for x in xs]
        for x, f in zip(xs, futs, strict=True):
            np.testing.assert_allclose(
                f.result(10), ref.matmul(model.mat_t, x), rtol=1e-5, atol=1e-5
            )


def test_chunked_arrays_both_ways(client, model, rng):
    """Arrays over the staging limit travel as chunks in both directions."""
    x = rng.standard_normal((3 * (1 << 20) // (4 * D) + 5, D)).astype(np.float32)
    with client.session(transport="grpc") as s:
        y = s.matmul_sync(model.mat, x)
    np.testing.assert_array_equal(y, client.matmul(model.mat, x))


def test_staged_chunks_are_admitted_against_the_owner(rng):
    """Chunks for request ids that never get a call are host memory the owner holds: past
    --max-staged-bytes-per-owner the request is refused (RESOURCE_EXHAUSTED when its call
    comes), and every staged byte is given back when the stream ends."""
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, max_staged_bytes_per_owner=1 << 20)
    ).start()
    try:
        with WorkerClient(srv.address) as w:
            mat = w.upload(np.eye(4, dtype=np.float32), None, fmt=0, in_features=4, out_features=4)
            piece = bytes(300 << 10)
            x = pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[1, 4], data=np.ones(4, "<f4").tobytes())
            reqs = [pb.SessionRequest(request_id=i, chunk=piece) for i in range(1, 9)]
            reqs.append(
                pb.SessionRequest(request_id=8, matmul=pb.MatmulRequest(handle=mat.handle, x=x))
            )
            gate = threading.Event()

            def requests():
                yield from reqs
                gate.wait(10)  # keep the stream open until the answer has been read

            out = []
            for resp in w._stub.Session(requests()):
                out.append(resp)
                assert srv.servicer.owners.held("")[2] <= 1 << 20
                gate.set()
            (resp,) = out
            assert resp.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "max-staged-bytes-per-owner" in resp.error.message
        assert wait_for(lambda: srv.servicer.owners.held("")[2] == 0)
    finally:
        srv.stop(0)
