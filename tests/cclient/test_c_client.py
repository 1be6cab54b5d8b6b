"""The C client (client/c, docs/c-client.md): libcoliworker_cuda.so and its test program
are built with the machine's C compiler and run against NumPy workers in subprocesses.

``build/test_abi`` checks every entry point against a float64 reference of its own; here it
runs against a worker started with small limits (so groups and ragged calls split), a worker
restarted mid-run (with and without COLIWORKER_RETAIN), two workers at once, a Unix socket,
and a worker that needs a token. At its "PAUSE" points this side looks at the worker's own
figures (what is resident, which KV sequences are left).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coliworker.client import WorkerClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from _rel import TOKENS, WorkerProcess, free_port, make_pki  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
TEST_ABI = BUILD / "test_abi"
RUN_TIMEOUT_S = 90

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler (cc) on this machine: the C client cannot be built",
)


@pytest.fixture(scope="module")
def built() -> Path:
    out = subprocess.run(
        [str(ROOT / "scripts" / "build-c")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, f"scripts/build-c failed:\n{out.stdout}\n{out.stderr}"
    assert "warning" not in out.stderr, f"the C client builds with warnings:\n{out.stderr}"
    return TEST_ABI


class _TlsWorker(WorkerProcess):
    """A worker whose gRPC port speaks TLS: serving once its data port accepts."""

    data_port = 0

    def serving(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.data_port), 0.5).close()
        except OSError:
            return False
        return True


def _worker(
    *args: str, env: dict[str, str] | None = None, kind: type[WorkerProcess] = WorkerProcess
) -> tuple[WorkerProcess, int]:
    data_port = free_port()
    w = kind("--data-port", str(data_port), *args, env=env)
    w.data_port = data_port  # type: ignore[attr-defined]
    return w.start(), data_port


def _resident(address: str, token: str | None = None) -> tuple[int, int, int]:
    """(tensors, handles, kv sequences) the worker holds for this caller's owner."""
    with WorkerClient(address, token=token) as c:
        devs = c.stats()
    return (
        sum(d.tensors for d in devs),
        sum(d.handles for d in devs),
        sum(d.kv_sequences for d in devs),
    )


def _run(
    program: Path,
    what: str,
    env: dict[str, str],
    on_pause: dict[str, Callable[[], None]] | None = None,
) -> str:
    """Run ``test_abi what``; answer each "PAUSE x" line after ``on_pause[x]()``."""
    proc = subprocess.Popen(
        [str(program), what],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PAUSE "):
                name = line.split()[1]
                if on_pause and name in on_pause:
                    on_pause[name]()
                proc.stdin.write("go\n")
                proc.stdin.flush()
            assert time.monotonic() < deadline, "test_abi ran too long:\n" + "".join(lines)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert rc == 0, f"test_abi {what} exited {rc}:\n{text}"
    assert "OK:" in text and "FAIL" not in text, text
    return text


def test_abi_against_a_numpy_worker(built: Path) -> None:
    """Every entry point, results against float64; groups of 17..64 experts go as several
    calls (--max-experts 16), ragged calls of 6 sequences as two (--max-sequences-per-call 4);
    idle sequences are freed on the worker, and everything is freed at the end."""
    w, port = _worker("--devices", "0,1", "--max-experts", "16", "--max-sequences-per-call", "4")
    seen: dict[str, tuple[int, int, int]] = {}
    try:
        _run(
            built,
            "all",
            {"COLIWORKER_ADDRESS": f"127.0.0.1:{port}"},
            {
                "idle-sequences": lambda: seen.__setitem__("idle", _resident(w.address)),
                "freed": lambda: seen.__setitem__("freed", _resident(w.address)),
            },
        )
    finally:
        w.stop()
    # the ragged test's kv_b, o_proj and its one sequence still in use; the rest were idle
    assert seen["idle"] == (2, 2, 1), seen
    assert seen["freed"] == (0, 0, 0), seen


@pytest.mark.parametrize("retain", ["0", "1"])
def test_worker_restart_mid_run(built: Path, retain: str) -> None:
    """The worker is killed and started again on the same ports while the program holds
    tensors, a KV sequence and an issued group: calls return 0, the library reconnects;
    with COLIWORKER_RETAIN=1 it uploads its host copies again and results are right."""
    w, port = _worker("--devices", "0,1")
    seen: dict[str, tuple[int, int, int]] = {}

    def restart() -> None:
        w.kill()
        w.start()

    try:
        _run(
            built,
            "restart",
            {"COLIWORKER_ADDRESS": f"127.0.0.1:{port}", "COLIWORKER_RETAIN": retain},
            {"restart": restart, "freed": lambda: seen.__setitem__("freed", _resident(w.address))},
        )
    finally:
        w.stop()
    assert seen["freed"] == (0, 0, 0), seen


def test_pooled_connections_the_worker_closed_are_dialled_again(built: Path) -> None:
    """The worker closes idle data-plane connections after 1 s (--data-idle-timeout); a call
    after a longer pause is served on a new connection, not refused."""
    w, port = _worker("--data-idle-timeout", "1")
    try:
        _run(built, "idle", {"COLIWORKER_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        w.stop()


def test_two_workers_and_a_unix_socket(built: Path) -> None:
    """COLIWORKER_ADDRESS lists two workers (the second on its Unix socket): the engine's
    device ids 0, 1 are the first worker's, 2 the second's."""
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "data.sock")
        a, port = _worker("--devices", "0,1")
        try:
            b, _ = _worker("--devices", "0", "--data-unix-socket", sock)
            try:
                address = f"127.0.0.1:{port},unix:{sock}"
                _run(built, "multi", {"COLIWORKER_ADDRESS": address})
                # the portable SHA-256 rounds (the worker checks every content hash)
                _run(built, "multi", {"COLIWORKER_ADDRESS": address, "COLIWORKER_NO_SHA_NI": "1"})
                assert _resident(b.address) == (0, 0, 0)
            finally:
                b.stop()
        finally:
            a.stop()


def test_token(built: Path, tmp_path: Path) -> None:
    """A worker with tokens: the HELLO carries COLIWORKER_TOKEN_FILE's token (the worker's own
    'name:token' line format); without one, init fails (0) instead of aborting."""
    token_file = tmp_path / "token"
    token_file.write_text(f"# the engine's token\nalice:{TOKENS['alice']}\n")
    w, port = _worker("--devices", "0,1,2", env={"COLIWORKER_TOKENS": f"alice:{TOKENS['alice']}"})
    try:
        env = {"COLIWORKER_ADDRESS": f"127.0.0.1:{port}", "COLIWORKER_TOKEN_FILE": str(token_file)}
        _run(built, "multi", env)
        with pytest.raises(AssertionError, match="refused"):
            _run(built, "multi", {"COLIWORKER_ADDRESS": f"127.0.0.1:{port}"})
        assert _resident(w.address, TOKENS["alice"]) == (0, 0, 0)
    finally:
        w.stop()


def test_mutual_tls(tmp_path: Path) -> None:
    """Built with COLIWORKER_WITH_TLS=1: mutual TLS on the data plane (the worker's own
    certificate, --tls-client-ca), the worker's address checked against its certificate."""
    if not os.path.exists("/usr/include/openssl/ssl.h"):
        pytest.skip("no OpenSSL headers (libssl-dev): the TLS build cannot be made")
    out = subprocess.run(
        [str(ROOT / "scripts" / "build-c")],
        cwd=ROOT,
        env={**os.environ, "COLIWORKER_WITH_TLS": "1", "COLIWORKER_BUILD_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    pki = make_pki(str(tmp_path))
    tls = ("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"])
    w, port = _worker(
        "--devices", "0,1,2", *tls, "--tls-client-ca", pki["ca_cert"], kind=_TlsWorker
    )
    try:
        env = {
            "COLIWORKER_ADDRESS": f"127.0.0.1:{port}",
            "COLIWORKER_TLS_CA": pki["ca_cert"],
            "COLIWORKER_TLS_CERT": pki["client_cert"],
            "COLIWORKER_TLS_KEY": pki["client_key"],
        }
        _run(tmp_path / "test_abi", "multi", env)
        no_cert = {k: v for k, v in env.items() if "CERT" not in k and "KEY" not in k}
        with pytest.raises(AssertionError, match="init over two workers"):
            _run(tmp_path / "test_abi", "multi", no_cert)
    finally:
        w.stop()
