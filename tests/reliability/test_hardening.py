"""Hardening (issue 16): unauthenticated load, TLS without client authentication, a SIGTERM
right after start, the token file, result types and what one owner learns about another.
One test per finding, each reproducing the attack against an in-process worker (NumPy
backend, loopback) and asserting the outcome, never a duration. What one owner's load may
cost another (threads, memory, state): ``test_owner_limits.py``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from _rel import (
    TOKENS,
    client,
    free_port,
    make_pki,
    random_tensor,
    serve,
    token_env,
    upload,
    wait_until,
)

from coliworker.client import (
    NotFound,
    WorkerClient,
)
from coliworker.server.auth import TokenTable
from coliworker.server.config import Config
from coliworker.server.health import MAX_WATCHES, probe
from coliworker.v1 import worker_pb2 as pb

WATCH = "/grpc.health.v1.Health/Watch"


# -- 1: unauthenticated calls and health Watch streams ---------------------------------------


def test_open_health_watches_fill_neither_the_in_flight_limit_nor_the_threads():
    srv = serve(tokens=token_env(), max_in_flight=8, workers=4)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            watch = ch.unary_stream(WATCH)
            streams = [watch(b"", timeout=60) for _ in range(MAX_WATCHES)]
            for s in streams:
                next(s)  # each is open and has answered SERVING
            extra = watch(b"", timeout=20)
            with pytest.raises(grpc.RpcError) as e:
                next(extra)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for _ in range(3):
                with client(srv, "alice") as w:
                    assert w.info().backend == "numpy"
                assert probe(srv.address) == 0
            for s in streams:
                s.cancel()
    finally:
        srv.stop(grace=None)


def test_unauthenticated_calls_do_not_count_against_the_in_flight_limit():
    srv = serve(tokens=token_env(), max_in_flight=2)
    try:
        chain = srv.server._state.interceptor_pipeline.interceptors
        guard = next(i for i in chain if hasattr(i, "in_flight"))
        with grpc.insecure_channel(srv.address) as ch:
            session = ch.stream_stream("/coliworker.v1.Worker/Session")
            for _ in range(10):
                with pytest.raises(grpc.RpcError) as e:
                    list(session(iter(()), timeout=10))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert guard.in_flight == 0
        with client(srv, "alice") as a, client(srv, "bob") as b:
            assert a.info().backend == b.info().backend == "numpy"
        assert wait_until(lambda: guard.in_flight == 0)
    finally:
        srv.stop(grace=None)


# -- 9: TLS alone is not authentication ------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def test_tls_without_client_authentication_is_refused_beyond_loopback(pki):
    tls = dict(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    with pytest.raises(ValueError, match="TLS alone"):
        serve(host="0.0.0.0", **tls)
    for ok in (dict(tls_client_ca=pki["ca_cert"]), dict(tokens=token_env()), dict(insecure=True)):
        serve(host="0.0.0.0", **tls, **ok).stop(grace=None)


# -- 10: a SIGTERM right after the port opens drains -----------------------------------------


def test_sigterm_as_soon_as_the_port_accepts_drains_and_exits_0():
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "coliworker", "serve", "--backend", "numpy"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"]
        cmd += ["--data-port", "0"]  # port + 1 may be taken by another test's worker
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.001)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert "draining" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.stderr.close()


# -- 12: the token file parser rejects what it does not understand ----------------------------


def test_token_file_rejects_entries_it_does_not_understand(tmp_path):
    a, b = "a" * 20, "b" * 20
    for line in (f"carol:{a},{b}", f"carol:{a} {b}", f"carol {a}", f"carol:{a}:{b}", f"c/d:{a}"):
        path = tmp_path / "tokens"
        path.write_text(f"# engines\nalice:{TOKENS['alice']}\n{line}\n")
        with pytest.raises(ValueError, match="--token-file: entry 3") as e:
            TokenTable.from_config(Config(token_file=str(path)))
        assert a not in str(e.value) and b not in str(e.value)
    table = TokenTable.from_config(Config(tokens=f"carol:{a},{b}"))  # the variable: commas
    assert table is not None and table.owner_of(a) == "carol" and table.owner_of(b) is not None


# -- 11: result types -------------------------------------------------------------------------


def test_output_dtype_outside_the_float_types_is_invalid_argument(rng):
    srv = serve()
    t = random_tensor(rng, 1, 16, 8)
    try:
        with WorkerClient(srv.address, timeout=20, progress=False) as w:
            h = upload(w, t)
            x = rng.standard_normal((2, 16)).astype(np.float32)
            stub = w._stub
            for dtype in (99, pb.DTYPE_INT32, pb.DTYPE_UINT8):
                req = pb.MatmulRequest(
                    handle=h.handle,
                    x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[2, 16], data=x.tobytes()),
                    output_dtype=dtype,
                )
                with pytest.raises(grpc.RpcError) as e:
                    stub.Matmul(req, timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert "output_dtype" in e.value.details()
    finally:
        srv.stop(grace=None)


# -- 12: what one owner learns about another --------------------------------------------------


def test_an_owner_learns_nothing_of_another_owners_content_counts_or_handles(rng):
    srv = serve(tokens=token_env())
    t = random_tensor(rng, 1, 32, 16)
    try:
        with client(srv, "alice") as a, client(srv, "bob") as b:
            ha = [upload(a, random_tensor(rng, 1, 32, 16)) for _ in range(4)]
            ids = sorted(h.handle for h in ha)
            assert all(y - x > 1 << 20 for x, y in zip(ids, ids[1:], strict=False))  # random
            h1 = upload(a, t)
            digest = srv.servicer.store.get(h1.handle, "x", "alice").data.content_hash
            for acquire in (False, True):
                r = b._stub.Lookup(pb.LookupRequest(content_hash=digest, acquire=acquire))
                assert not r.found  # only by sending the bytes
            hb = upload(b, t)  # sent and verified: stored once, bob's own handle
            assert hb.deduplicated
            info = a._stub.Lookup(pb.LookupRequest(content_hash=digest, acquire=True))
            assert info.found and info.tensor.references == 2  # alice's two, not bob's
            assert [d.handles for d in b.stats()][0] == 1  # bob sees his own only
            assert [d.tensors for d in b.stats()][0] == 1
            a.free(ha[0])
            texts = set()
            for handle in (ha[0].handle, ha[1].handle, 12345):  # freed, another's, never issued
                with pytest.raises(NotFound) as e:
                    b.matmul(handle, rng.standard_normal((1, 32)).astype(np.float32))
                texts.add(e.value.message.replace(str(handle), "N"))
            assert len(texts) == 1
    finally:
        srv.stop(grace=None)
