"""Helpers of the reliability tests: tensors, in-process and subprocess workers, certificates."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np
from _tensors import TOL, host_arrays, random_tensor, rel_err, upload  # noqa: F401 (re-exported)

from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb

TOKENS = {
    "alice": "alice-token-0123456789abcdef",
    "bob": "bob-token-0123456789abcdef00",
}


def client(server, who: str | None, **kw):
    """A client of ``server`` as owner ``who`` (a TOKENS name; None: no token)."""
    from coliworker.client import WorkerClient

    return WorkerClient(server.address, timeout=20, progress=False, token=TOKENS.get(who), **kw)


def wait_until(predicate, seconds: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``seconds`` pass (its last answer)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def token_env(names=("alice", "bob")) -> str:
    return ",".join(f"{n}:{TOKENS[n]}" for n in names)


def serve(**overrides) -> object:
    """An in-process worker (NumPy backend, devices 0 and 1) on a free port, started."""
    values = dict(host="127.0.0.1", port=0, backend="numpy", devices=(0, 1), metrics_port=None)
    values.update(overrides)
    return build_server(Config(**values)).start()


@dataclass
class Mla:
    """A small MLA layer: kv_b [H*(Q+V), K] and o_proj [D, H*V] (fmt 2)."""

    heads: int = 2
    q_dim: int = 8
    rope_dim: int = 4
    v_dim: int = 8
    k: int = 16
    d_out: int = 12

    def tensors(self, rng):
        kv_b = random_tensor(rng, 2, self.k, self.heads * (self.q_dim + self.v_dim))
        o_proj = random_tensor(rng, 2, self.heads * self.v_dim, self.d_out)
        return kv_b, o_proj

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.q_dim + self.rope_dim))

    def dims(self) -> dict:
        return dict(q_dim=self.q_dim, rope_dim=self.rope_dim, v_dim=self.v_dim, scale=self.scale)

    def q(self, rng, s: int) -> np.ndarray:
        return rng.standard_normal((s, self.heads, self.q_dim + self.rope_dim)).astype(np.float32)

    def rows(self, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            rng.standard_normal((n, self.k)).astype(np.float32),
            rng.standard_normal((n, self.rope_dim)).astype(np.float32),
        )

    def reference(self, kv_b, o_proj, q, latents, ropes) -> np.ndarray:
        return ref.attention_ragged(
            kv_b, o_proj, q, latents, ropes, self.q_dim, self.rope_dim, self.v_dim, self.scale
        )


# -- subprocess workers ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """``python -m coliworker serve`` in a subprocess, restartable on the same port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> WorkerProcess:
        cmd = [sys.executable, "-m", "coliworker", "serve", "--backend", "numpy"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0"]
        if "--data-port" not in self.args:  # port + 1 may be taken: any free one
            cmd += ["--data-port", "0"]
        self.proc = subprocess.Popen(
            cmd + list(self.args),
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker exited {self.proc.returncode}: {self.proc.stderr.read()}"
                )
            if self.serving():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"worker on port {self.port} did not start within {timeout} s")

    def serving(self) -> bool:
        raw = b""
        try:
            with grpc.insecure_channel(self.address) as ch:
                reply = ch.unary_unary("/grpc.health.v1.Health/Check")(raw, timeout=1)
        except grpc.RpcError:
            return False
        return reply[:2] == b"\x08\x01"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


# -- certificates ----------------------------------------------------------------------------


def running(procs: list[WorkerProcess]):
    """Start every worker of ``procs``, yield the list, stop them all (a fixture's body)."""
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def make_pki(directory: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (PEM
    files in ``directory``); returns their paths by name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, ca: bool, usage=None, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert(name("coliworker test CA"), ca_key, name("coliworker test CA"), ca_key, True)
    out: dict[str, str] = {}

    def write(label: str, c, key) -> None:
        out[label + "_cert"] = os.path.join(directory, f"{label}.pem")
        with open(out[label + "_cert"], "wb") as f:
            f.write(c.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            out[label + "_key"] = os.path.join(directory, f"{label}.key")
            with open(out[label + "_key"], "wb") as f:
                f.write(
                    key.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    )
                )

    write("ca", ca, None)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = cert(
        name("localhost"),
        server_key,
        ca.subject,
        ca_key,
        False,
        ExtendedKeyUsageOID.SERVER_AUTH,
        san,
    )
    write("server", server, server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = cert(
        name("engine"), client_key, ca.subject, ca_key, False, ExtendedKeyUsageOID.CLIENT_AUTH
    )
    write("client", client, client_key)
    return out


def stats_snapshot(w) -> list[tuple]:
    return [(d.device, d.tensors, d.tensor_bytes, d.handles, d.kv_sequences) for d in w.stats()]


class DecodeLayer:
    """int4 experts (16 -> 12 -> 16) and one MLA layer whose sequences' rows the host keeps:
    what the restart tests upload, call and check against the float64 reference."""

    def __init__(self, rng: np.random.Generator, n_experts: int, sequences: tuple[int, ...]):
        self.rng = rng
        self.sequences = sequences
        self.experts = [
            (
                random_tensor(rng, 2, 16, 12),
                random_tensor(rng, 2, 16, 12),
                random_tensor(rng, 2, 12, 16),
            )
            for _ in range(n_experts)
        ]
        self.mla = Mla()
        self.kv_b, self.o_proj = self.mla.tensors(rng)
        self.latent = {s: np.zeros((0, self.mla.k), np.float32) for s in sequences}
        self.rope = {s: np.zeros((0, self.mla.rope_dim), np.float32) for s in sequences}

    def upload(self, w) -> None:
        self.refs = [tuple(upload(w, t) for t in e) for e in self.experts]
        self.kv_ref, self.o_ref = upload(w, self.kv_b), upload(w, self.o_proj)

    def next_rows(self) -> tuple[np.ndarray, list[tuple]]:
        """One decode step's ragged input: q and, per sequence, (id, start, latent, rope) of
        one new row, which the host history keeps."""
        m = self.mla
        q = m.q(self.rng, len(self.sequences))
        seqs = []
        for sid in self.sequences:
            lat, rop = m.rows(self.rng, 1)
            seqs.append((sid, len(self.latent[sid]), lat, rop))
            self.latent[sid] = np.concatenate([self.latent[sid], lat])
            self.rope[sid] = np.concatenate([self.rope[sid], rop])
        return q, seqs

    def attention_reference(self, q: np.ndarray) -> np.ndarray:
        """Ragged attention of q over every sequence's whole history."""
        lats = [self.latent[s] for s in self.sequences]
        ropes = [self.rope[s] for s in self.sequences]
        return self.mla.reference(self.kv_b, self.o_proj, q, lats, ropes)


__all__ = ["pb"]
