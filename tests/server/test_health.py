"""The grpc.health.v1 service (``server/health.py``): every watcher sees each status change,
a change made while watchers disconnect never waits on a lock their close callbacks take
(grpcio-health-checking's own Watch did: a worker stopping with open watches hung in
``set_not_serving``), and Check, List and Watch answer from the one status registry."""

from __future__ import annotations

import threading

import grpc
import pytest

from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.server.health import WORKER_SERVICE, Health

grpc_health = pytest.importorskip("grpc_health.v1.health_pb2")
SERVING = grpc_health.HealthCheckResponse.SERVING
NOT_SERVING = grpc_health.HealthCheckResponse.NOT_SERVING
UNKNOWN = grpc_health.HealthCheckResponse.SERVICE_UNKNOWN
WATCH = "/grpc.health.v1.Health/Watch"


class Context:
    """A stream's context as gRPC's server gives it: callbacks run when the stream ends."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_callback(self, cb) -> bool:
        self.callbacks.append(cb)
        return True

    def end(self) -> None:
        for cb in self.callbacks:
            cb()


class Details:
    method = WATCH


def watch(health: Health, service: str, send, ctx: Context) -> None:
    """Open a Watch as gRPC's server does: the interceptor's non-blocking handler."""
    handler = health.interceptor().intercept_service(None, Details())
    handler.unary_stream(grpc_health.HealthCheckRequest(service=service), ctx, send)


def test_a_status_is_sent_with_no_lock_held_that_a_closing_stream_needs():
    health = Health()
    ctx, sent, ended = Context(), [], threading.Event()

    def send(response) -> None:
        """gRPC's send waits for its completion thread, which runs the close callbacks of
        streams ending meanwhile: here one ends during the send, on another thread."""
        sent.append(response.status)
        if len(sent) == 2:
            closer = threading.Thread(target=lambda: (ctx.end(), ended.set()))
            closer.start()
            closer.join(10)

    watch(health, "", send, ctx)
    health.set_serving()
    assert ended.is_set(), "the close callback waited on a lock held by the status change"
    assert sent == [NOT_SERVING, SERVING]
    health.set_not_serving()  # the stream has ended: nothing more is sent to it
    assert sent == [NOT_SERVING, SERVING]


def test_each_watcher_ends_on_the_latest_status_and_unknown_services_are_unknown():
    health = Health()
    got: dict[str, list[int]] = {"": [], WORKER_SERVICE: [], "other": []}
    for service, seen in got.items():
        watch(health, service, lambda r, seen=seen: seen.append(r.status), Context())
    health.set_serving()
    health.set_serving()  # no change: nothing sent
    health.shutdown()
    health.set_serving()  # after a graceful shutdown: ignored
    assert got[""] == got[WORKER_SERVICE] == [NOT_SERVING, SERVING, NOT_SERVING]
    assert got["other"] == [UNKNOWN]


@pytest.mark.parametrize("round_", range(3))
def test_stop_with_watchers_disconnecting_completes_and_the_others_see_not_serving(round_):
    srv = build_server(
        Config(host="127.0.0.1", port=0, backend="numpy", metrics_port=None, data_port=None)
    ).start()
    stopper = threading.Thread(target=lambda: srv.stop(grace=None), daemon=True)
    with grpc.insecure_channel(srv.address) as gone, grpc.insecure_channel(srv.address) as kept:
        raw = grpc_health.HealthCheckRequest(service="").SerializeToString()
        leaving = [gone.unary_stream(WATCH)(raw, timeout=60) for _ in range(24)]
        staying = [kept.unary_stream(WATCH)(raw, timeout=60) for _ in range(8)]
        for s in leaving + staying:
            assert next(s)[:2] == b"\x08\x01"  # SERVING
        for s in leaving:
            s.cancel()  # their close callbacks race with the stop's status change
        stopper.start()
        stopper.join(60)
        assert not stopper.is_alive(), "stop() hung sending NOT_SERVING to the watchers"
        for s in staying:
            try:
                status = next(s)
            except grpc.RpcError:  # the server went before this watcher read its last status
                continue
            assert status[:2] == b"\x08\x02"  # NOT_SERVING


def test_check_list_and_watch_answer_from_one_registry():
    """Over gRPC: Check and List follow every change Watch sees (one store of statuses); an
    unknown service is NOT_FOUND to Check and SERVICE_UNKNOWN to Watch."""
    from grpc_health.v1 import health_pb2_grpc

    srv = build_server(
        Config(host="127.0.0.1", port=0, backend="numpy", metrics_port=None, data_port=None)
    ).start()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            req = grpc_health.HealthCheckRequest
            stream = stub.Watch(req(service=WORKER_SERVICE), timeout=60)
            assert next(stream).status == SERVING
            for service in ("", WORKER_SERVICE):
                assert stub.Check(req(service=service), timeout=10).status == SERVING
            listed = stub.List(grpc_health.HealthListRequest(), timeout=10).statuses
            want = {"": SERVING, WORKER_SERVICE: SERVING}
            assert {k: v.status for k, v in listed.items()} == want
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(req(service="other"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert next(stub.Watch(req(service="other"), timeout=60)).status == UNKNOWN
            srv.health.set_not_serving()
            assert next(stream).status == NOT_SERVING
            assert stub.Check(req(service=WORKER_SERVICE), timeout=10).status == NOT_SERVING
            stream.cancel()
    finally:
        srv.stop(grace=None)
