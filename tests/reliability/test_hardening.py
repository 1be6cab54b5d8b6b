"""Hardening (issue 16): no owner can starve, crash or read past another; memory stays inside
the limits. One test per finding, each reproducing the attack against an in-process worker
(NumPy backend, loopback) and asserting the outcome, never a duration."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from _rel import TOKENS, free_port, make_pki, serve, token_env

from coliworker.client import ResourceExhausted, WorkerClient
from coliworker.server.auth import TokenTable
from coliworker.server.config import Config
from coliworker.server.health import MAX_WATCHES
from coliworker.tools.health import probe

WATCH = "/grpc.health.v1.Health/Watch"


def client(server, who: str | None, **kw) -> WorkerClient:
    return WorkerClient(server.address, timeout=20, progress=False, token=TOKENS.get(who), **kw)


def wait_until(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


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


# (the remaining findings follow below)
_ = (threading, np, ResourceExhausted)
