"""What one decode call costs a seed-ABI engine beyond its compute: the C client
(``build/libcoliworker_cuda.so``) over loopback to a worker whose compute is a stub, on any
machine.

In one process: a NumPy worker (metrics on, as deployed) whose ``expert_group`` and
``attention_ragged`` return a preallocated result at once (the ragged one still stages and
keeps each new KV row, as the C client's sequence bookkeeping needs), and the C library
loaded with ctypes, which releases the GIL while a call is out. Timed per call (median us of
``--calls``): the two calls of a GLM-5.2 decode layer as the seed's ABI makes them,
``coli_cuda_expert_group`` of 8 experts x 1 row (the token's row once per expert, D = 6144)
and ``coli_cuda_attention_project_ragged`` of one sequence (64 heads, one new KV row). What
remains is the engine-to-result path: the C client's request and reply, loopback TCP, the
worker's data plane, its checks, store and metrics, the backend's call around its compute.

``--rounds`` runs alternate ``COLIWORKER_FASTPATH`` 0 and 1, each in a process of its own
(the data plane's compiled frame path, server/fastpath.py), so the table sets the two side
by side.

    scripts/build-c lib && python bench/c_client_cost.py [--rounds 3] [--calls 3000]
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "build", "libcoliworker_cuda.so")
D, I_E, H, Q, R, V, K, D_OUT = 6144, 64, 64, 192, 64, 256, 512, 6144
P = C.c_void_p


def measure(calls: int) -> dict[str, float]:
    """This process's figures: a stubbed worker, the C library on it, each call timed."""
    from coliworker.server.app import build_server
    from coliworker.server.backend import Result
    from coliworker.server.config import Config

    srv = build_server(Config(backend="numpy", port=0, metrics_port=0)).start()
    be = srv.servicer.backend
    out_group = np.zeros((8, D), np.float32)
    out_ragged = np.zeros((1, D_OUT), np.float32)
    be.expert_group = lambda *a, **k: Result(out_group)

    def ragged(kv_b, o_proj, q, caches, q_dim, rope_dim, v_dim, scale, rows=None):
        fresh = [0] * len(caches)
        if rows is not None:
            fresh = [c.stage(lat, rop) for c, (lat, rop) in zip(caches, rows, strict=True)]
        for c, n in zip(caches, fresh, strict=True):
            c.length += n
        return Result(out_ragged)

    be.attention_ragged = ragged
    os.environ["COLIWORKER_ADDRESS"] = f"127.0.0.1:{srv.data.port}"
    lib = C.CDLL(LIB)
    lib.coli_cuda_init.argtypes = [C.POINTER(C.c_int), C.c_int]
    ints: list = [C.c_int] * 7
    lib.coli_cuda_tensor_upload.argtypes = [C.POINTER(P), P, P, *ints[:4]]
    lib.coli_cuda_expert_group.argtypes = [P, P, P, P, C.c_int, P, P]
    lib.coli_cuda_attention_project_ragged.argtypes = [P] * 8 + ints + [C.c_float]
    assert lib.coli_cuda_init((C.c_int * 1)(0), 1)
    rng = np.random.default_rng(0)

    def upload(i: int, o: int) -> P:
        w = rng.integers(0, 256, size=(o, i // 2), dtype=np.uint8)
        s = (rng.random(o, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
        t = P()
        assert lib.coli_cuda_tensor_upload(C.byref(t), w.ctypes.data, s.ctypes.data, 2, i, o, 0)
        return t

    experts = [(upload(D, I_E), upload(D, I_E), upload(I_E, D)) for _ in range(8)]
    g, u, d = ((P * 8)(*[e[j] for e in experts]) for j in range(3))
    rows = (C.c_int * 8)(*([1] * 8))
    x = np.repeat(rng.standard_normal((1, D), dtype=np.float32), 8, axis=0)
    y = np.zeros_like(x)

    def group() -> None:
        assert lib.coli_cuda_expert_group(g, u, d, rows, 8, y.ctypes.data, x.ctypes.data)

    kv_b, proj = upload(K, H * (Q + V)), upload(H * V, D_OUT)
    cap = calls + 300
    lat = rng.standard_normal((cap, K), dtype=np.float32)
    rope = rng.standard_normal((cap, R), dtype=np.float32)
    keys, lp, rp = (P * 1)(lat.ctypes.data), (P * 1)(lat.ctypes.data), (P * 1)(rope.ctypes.data)
    q = rng.standard_normal((1, H, Q + R), dtype=np.float32)
    out = np.zeros((1, D_OUT), np.float32)
    length = [0]

    def attend() -> None:
        length[0] += 1
        n = (C.c_int * 1)(length[0])
        assert lib.coli_cuda_attention_project_ragged(
            kv_b, proj, out.ctypes.data, q.ctypes.data, keys, lp, rp, n, 1, H, Q, R, V, K,
            cap, 0.1
        )  # fmt: skip

    result = {}
    for name, fn, n in (("expert_group 8x1", group, calls), ("ragged 1 seq", attend, calls)):
        for _ in range(200):
            fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        result[name] = statistics.median(ts) / 1e3
    result["fast path"] = srv.servicer.fastcalls is not None
    srv.stop(0)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.calls)))
        return
    if not os.path.exists(LIB):
        subprocess.run([os.path.join(ROOT, "scripts", "build-c"), "lib"], check=True)
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(a.rounds):
        for fast in ("0", "1"):
            env = dict(os.environ, COLIWORKER_FASTPATH=fast)
            cmd = [sys.executable, __file__, "--child", "--calls", str(a.calls)]
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[fast].append(json.loads(got.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} FASTPATH={fast}: {runs[fast][-1]}", flush=True)
    assert not any(x["fast path"] for x in runs["0"]) and all(x["fast path"] for x in runs["1"])
    date, doc = harness.run_record("bench/c_client_cost.py")
    doc["runs"] = runs
    mc = doc["machine"]
    stem = harness.write_json(a.out, f"c-client-cost-{date:%Y-%m-%d}-{mc['host']}", doc)
    lines = [
        "# bench/c_client_cost.py — a seed-ABI decode call through the C client, compute stubbed",
        "",
        f"- date: {doc['date']}; commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, python {mc['python']}",
        f"- command: `{doc['command']}`; median us per call of {a.calls}, each round a process",
        "",
        "| call | FASTPATH=0 (each round) | FASTPATH=1 (each round) | median of rounds, 0 / 1 |",
        "|---|---|---|---|",
    ]
    for name in ("expert_group 8x1", "ragged 1 seq"):
        off = [x[name] for x in runs["0"]]
        on = [x[name] for x in runs["1"]]
        lines.append(
            f"| {name} | {' / '.join(f'{v:.1f}' for v in off)} | "
            f"{' / '.join(f'{v:.1f}' for v in on)} | "
            f"{statistics.median(off):.1f} / {statistics.median(on):.1f} |"
        )
    harness.write_md(stem, lines)


if __name__ == "__main__":
    main()
