"""Load: 16 concurrent clients x 500 mixed calls against one worker, every result checked
against the float64 reference, no errors; the latency percentiles are printed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _rel import TOKENS, Mla, random_tensor, rel_err, serve, token_env, upload

from coliworker.client import WorkerClient
from coliworker.kernels import reference as ref

pytestmark = pytest.mark.slow

CLIENTS = 16
CALLS = 500


def run_client(address: str, index: int, shared: dict, latencies: list, errors: list) -> None:
    rng = np.random.default_rng(1000 + index)
    owner = ("alice", "bob")[index % 2]
    refs = shared[owner]
    m: Mla = shared["mla"]
    t, experts = shared["t"], shared["experts"]
    sid = 100 + index
    latent = np.zeros((0, m.k), np.float32)
    rope = np.zeros((0, m.rope_dim), np.float32)
    try:
        with WorkerClient(address, timeout=60, progress=False, token=TOKENS[owner]) as w:
            for i in range(CALLS):
                kind = i % 8
                t0 = time.perf_counter()
                if kind == 0:
                    x = rng.standard_normal((2, 16)).astype(np.float32)
                    ok = rel_err(w.matmul(refs["t"], x), ref.matmul(t, x)) < 1e-5
                elif kind == 1:
                    x = rng.standard_normal((3, 16)).astype(np.float32)
                    ok = (
                        rel_err(
                            w.expert_mlp(*refs["experts"][0], x), ref.expert_mlp(*experts[0], x)
                        )
                        < 1e-5
                    )
                elif kind == 2:
                    rows = [1, 2, 1]
                    x = rng.standard_normal((4, 16)).astype(np.float32)
                    y = w.expert_group(refs["experts"], rows, x)
                    ok = rel_err(y, ref.expert_group(experts, rows, x)) < 1e-5
                elif kind == 3:
                    x = rng.standard_normal((3, 16)).astype(np.float32)
                    routes = rng.integers(0, 3, (3, 2)).astype(np.int32)
                    wt = rng.random((3, 2)).astype(np.float32)
                    y = w.expert_group_routed(refs["experts"], x, routes, wt)
                    ok = rel_err(y, ref.expert_group_routed(experts, x, routes, wt)) < 1e-5
                elif kind in (4, 5):
                    lat, rop = m.rows(rng, 1)
                    q = m.q(rng, 1)
                    y = w.attention_ragged(
                        refs["kv"],
                        refs["o"],
                        q,
                        sequences=[(sid, len(latent), lat, rop)],
                        **m.dims(),
                    )
                    latent, rope = np.concatenate([latent, lat]), np.concatenate([rope, rop])
                    ok = (
                        rel_err(
                            y, m.reference(shared["kv_b"], shared["o_proj"], q, [latent], [rope])
                        )
                        < 1e-5
                    )
                elif kind == 6:
                    q = m.q(rng, 2)
                    lat, rop = m.rows(rng, 5)
                    y = w.attention(refs["kv"], q, lat, rop, o_proj=refs["o"], **m.dims())
                    want = ref.attention(
                        shared["kv_b"],
                        shared["o_proj"],
                        q,
                        lat,
                        rop,
                        m.q_dim,
                        m.rope_dim,
                        m.v_dim,
                        m.scale,
                    )
                    ok = rel_err(y, want) < 1e-5
                else:
                    tt = random_tensor(rng, 2, 16, 4)
                    h = upload(w, tt)
                    x = rng.standard_normal((1, 16)).astype(np.float32)
                    ok = rel_err(w.matmul(h, x), ref.matmul(tt, x)) < 1e-5
                    w.free(h)
                latencies.append(time.perf_counter() - t0)
                if not ok:
                    errors.append(f"client {index} call {i} (kind {kind}): wrong result")
            w.free_sequence(sid)
    except Exception as exc:  # noqa: BLE001 - collected and asserted below
        errors.append(f"client {index}: {type(exc).__name__}: {exc}")


def test_sixteen_clients_times_five_hundred_mixed_calls(rng, capsys):
    # 8 clients of each owner upload at once: the worker allows that many per owner
    # (--max-uploads-per-owner; one owner may hold at most half the non-reserved threads)
    srv = serve(tokens=token_env(), workers=32, max_uploads_per_owner=8)
    try:
        m = Mla()
        kv_b, o_proj = m.tensors(rng)
        t = random_tensor(rng, 2, 16, 8)
        experts = [
            (
                random_tensor(rng, 2, 16, 12),
                random_tensor(rng, 4, 16, 12, 8),
                random_tensor(rng, 1, 12, 16),
            )
            for _ in range(3)
        ]
        shared = {"mla": m, "kv_b": kv_b, "o_proj": o_proj, "t": t, "experts": experts}
        for owner in ("alice", "bob"):
            with WorkerClient(srv.address, timeout=30, progress=False, token=TOKENS[owner]) as w:
                shared[owner] = {
                    "t": upload(w, t),
                    "experts": [tuple(upload(w, x) for x in e) for e in experts],
                    "kv": upload(w, kv_b),
                    "o": upload(w, o_proj),
                }
        latencies: list[float] = []
        errors: list[str] = []
        threads = [
            threading.Thread(target=run_client, args=(srv.address, i, shared, latencies, errors))
            for i in range(CLIENTS)
        ]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        wall = time.perf_counter() - t0
        assert not errors, errors[:5]
        assert len(latencies) == CLIENTS * CALLS
        p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
        with capsys.disabled():
            print(
                f"\nload: {CLIENTS} clients x {CALLS} mixed calls = {len(latencies)} calls in "
                f"{wall:.1f} s ({len(latencies) / wall:.0f} calls/s), p50 {p50:.1f} ms, "
                f"p99 {p99:.1f} ms, errors 0"
            )
        for owner in ("alice", "bob"):  # Stats are per owner: 12 handles each, nothing leaked
            with WorkerClient(srv.address, timeout=30, token=TOKENS[owner]) as w:
                s = w.stats()[0]
                assert s.kv_sequences == 0 and s.handles == 12, owner
    finally:
        srv.stop(grace=None)
