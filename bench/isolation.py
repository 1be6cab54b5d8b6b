"""Owner isolation under attack: one owner (mallory) runs the attacks of issue 16's items 1-3
and 8 while another (alice) makes checked calls; every one of alice's results must be right.

    python bench/isolation.py [--calls 600] [--out bench/results/isolation-DATE.json]

The worker is a subprocess (NumPy backend, loopback, two tokens, --workers 16, --quota 64M,
--memory-limit 256M, --max-pending-tickets 8, --idle-timeout 2). Mallory, in threads:
40 health Watch streams and a loop of unauthenticated calls (1); her maximum of idle Session
streams and stalled uploads, reopened as the worker ends them (2); upload headers that claim
resident content of a 256 MiB spec (3a); her tickets held at the limit, KV grown against the
budget, and slow ragged calls on her own kv_b (8). Alice: matmul, routed expert group and
ragged attention in turn, each checked against the float64 reference; p50/p99 over all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reliability"))
from _rel import Mla, arrays, random_tensor, rel_err, upload  # noqa: E402

from coliworker.client import WorkerClient, WorkerError  # noqa: E402
from coliworker.kernels import reference as ref  # noqa: E402
from coliworker.v1 import worker_pb2 as pb  # noqa: E402
from coliworker.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402
from coliworker.wire.codec import content_hash  # noqa: E402

TOKENS = {"alice": "alice-token-0123456789abcdef", "mallory": "mallory-token-0123456789abcd"}
ARGS = [
    "--workers", "16", "--quota", "64M", "--memory-limit", "256M",
    "--max-pending-tickets", "8", "--idle-timeout", "2", "--metrics-port", "0",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Attacks:
    def __init__(self, address: str, rng: np.random.Generator) -> None:
        self.address, self.rng = address, rng
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.md = [("authorization", f"Bearer {TOKENS['mallory']}")]
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def run(self, fn) -> threading.Thread:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    fn()
                except (grpc.RpcError, WorkerError, StopIteration):
                    pass

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        return t

    def stalled(self, first):
        yield first
        self.stop.wait(30)

    # 1: health Watch streams and unauthenticated calls
    def watches(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            streams = [ch.unary_stream("/grpc.health.v1.Health/Watch")(b"") for _ in range(40)]
            self.count("watch streams opened")
            self.stop.wait(60)
            for s in streams:
                s.cancel()

    def unauthenticated(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            while not self.stop.is_set():
                try:
                    stub.Info(pb.InfoRequest(), timeout=5)
                except grpc.RpcError:
                    self.count("unauthenticated calls")

    # 2: idle sessions and stalled uploads, reopened as the worker ends or refuses them
    def streams(self) -> None:
        t = random_tensor(self.rng, 1, 1024, 64)
        w, s = arrays(t)
        digest = content_hash(1, 1024, 64, 0, w, s)
        header = pb.UploadChunk(
            header=pb.UploadHeader(
                spec=pb.TensorSpec(fmt=1, in_features=1024, out_features=64),
                content_hash=digest,
                weight_bytes=w.nbytes,
                scale_bytes=s.nbytes,
            )
        )
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            held = []
            for _ in range(8):
                held.append(stub.Session(self.stalled(pb.SessionRequest()), metadata=self.md))
                held.append(stub.Upload.future(self.stalled(header), metadata=self.md))
            for f in held:
                try:
                    f.result() if hasattr(f, "result") else next(f)
                except (grpc.RpcError, StopIteration):
                    self.count("streams ended or refused")

    # 3(a): headers claiming resident content under a 256 MiB spec
    def claims(self, digest: bytes) -> None:
        n = 1 << 14
        header = pb.UploadChunk(
            header=pb.UploadHeader(
                spec=pb.TensorSpec(fmt=1, in_features=n, out_features=n),
                content_hash=digest,
                weight_bytes=n * n,
                scale_bytes=4 * n,
            )
        )
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            while not self.stop.is_set():
                try:
                    stub.Upload(iter([header]), metadata=self.md, timeout=10)
                except grpc.RpcError:
                    self.count("256 MiB claims refused")

    # 8: tickets at the limit, KV against the budget, slow ragged calls on her kv_b
    def owner_load(self) -> None:
        m = Mla(k=512, rope_dim=64)
        kv_b, o_proj = m.tensors(self.rng)
        with WorkerClient(self.address, token=TOKENS["mallory"], timeout=60, progress=False) as w:
            ex = [
                tuple(
                    upload(w, random_tensor(self.rng, 2, *io))
                    for io in ((64, 48),) * 2 + ((48, 64),)
                )
            ]
            k, o = upload(w, kv_b), upload(w, o_proj)
            sid = 0
            while not self.stop.is_set():
                tickets = []
                try:
                    for _ in range(9):
                        tickets.append(
                            w.expert_group_async(ex, [4], self.rng.standard_normal((4, 64)))
                        )
                except WorkerError:
                    self.count("tickets refused at her limit")
                sid += 1
                lat, rop = m.rows(self.rng, 20000)
                try:
                    w.attention_ragged(
                        k, o, m.q(self.rng, 1), sequences=[(sid, 0, lat, rop)], **m.dims()
                    )
                    self.count("her big KV sequences")
                except WorkerError:
                    self.count("her KV growth refused")
                for t in tickets:
                    t.result()


def victim(address: str, rng: np.random.Generator, calls: int) -> dict:
    m = Mla()
    kv_b, o_proj = m.tensors(rng)
    t = random_tensor(rng, 2, 256, 128)
    experts = [
        tuple(random_tensor(rng, 2, *io) for io in ((64, 48), (64, 48), (48, 64))) for _ in range(8)
    ]
    times, errors, wrong = [], 0, 0
    with WorkerClient(address, token=TOKENS["alice"], timeout=60, progress=False) as w:
        h = upload(w, t)
        refs = [tuple(upload(w, x) for x in e) for e in experts]
        k, o = upload(w, kv_b), upload(w, o_proj)
        lat_all, rop_all = m.rows(rng, 0)
        for i in range(calls):
            kind = i % 3
            t0 = time.perf_counter()
            try:
                if kind == 0:
                    x = rng.standard_normal((4, 256)).astype(np.float32)
                    ok = rel_err(w.matmul(h, x), ref.matmul(t, x)) < 1e-5
                elif kind == 1:
                    x = rng.standard_normal((1, 64)).astype(np.float32)
                    routes = rng.choice(8, size=(1, 4), replace=False).astype(np.int32)
                    wts = rng.random((1, 4)).astype(np.float32)
                    y = w.expert_group_routed(refs, x, routes, wts)
                    ok = rel_err(y, ref.expert_group_routed(experts, x, routes, wts)) < 1e-5
                else:
                    lat, rop = m.rows(rng, 1)
                    q = m.q(rng, 1)
                    y = w.attention_ragged(
                        k, o, q, sequences=[(1, len(lat_all), lat, rop)], **m.dims()
                    )
                    lat_all, rop_all = (
                        np.concatenate([lat_all, lat]),
                        np.concatenate([rop_all, rop]),
                    )
                    ok = rel_err(y, m.reference(kv_b, o_proj, q, [lat_all], [rop_all])) < 1e-5
                wrong += not ok
            except WorkerError as exc:
                errors += 1
                print(f"alice call {i}: {exc}", file=sys.stderr)
            times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {
        "calls": calls,
        "errors": errors,
        "wrong_results": wrong,
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "COLIWORKER_TOKENS": ",".join(f"{k}:{v}" for k, v in TOKENS.items())}
    cmd = [sys.executable, "-m", "coliworker", "serve", "--backend", "numpy", "--port", str(port)]
    proc = subprocess.Popen(cmd + ARGS, env=env, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    rng = np.random.default_rng()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with WorkerClient(address, token=TOKENS["alice"], timeout=2) as w:
                    w.info()
                break
            except WorkerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        baseline = victim(address, rng, args.calls // 3)
        with WorkerClient(address, token=TOKENS["alice"], timeout=20, progress=False) as w:
            shared = random_tensor(rng, 1, 512, 64)
            upload(w, shared)
            a, s = arrays(shared)
            digest = content_hash(1, 512, 64, 0, a, s)
        atk = Attacks(address, rng)
        threads = [threading.Thread(target=atk.watches, daemon=True)]
        threads[0].start()
        threads += [atk.run(atk.unauthenticated), atk.run(atk.streams)]
        threads += [atk.run(lambda: atk.claims(digest)), atk.run(atk.owner_load)]
        time.sleep(3)  # let every attack get going
        under = victim(address, rng, args.calls)
        atk.stop.set()
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
            drained = True
        except subprocess.TimeoutExpired:  # reported, then ended
            drained = False
            proc.kill()
            proc.wait(10)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": "python bench/isolation.py " + " ".join(sys.argv[1:]),
        "worker_args": ARGS,
        "alone": baseline,
        "under_attack": under,
        "attacks": atk.counts,
        "worker_alive_after": alive,
        "worker_exited_within_30s_of_sigterm": drained,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if under["errors"] == 0 and under["wrong_results"] == 0 and alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
