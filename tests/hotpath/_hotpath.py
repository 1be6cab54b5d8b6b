"""Shared pieces of the hot-path tests (fixtures are in conftest.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from coliworker.client import WorkerClient
from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, row_bytes

D, I_E = 48, 24  # hidden and expert widths (odd-ish sizes, not tile multiples)
H, Q, R, V, K, D_OUT = 2, 8, 4, 8, 16, 20  # MLA dims


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def mapped(name: str) -> bool:
    """Whether this process maps a file whose path contains ``name`` (a shm segment)."""
    with open("/proc/self/maps") as f:
        return name in f.read()


def int4_tensor(rng: np.random.Generator, i: int, o: int) -> QTensor:
    w = rng.integers(0, 256, size=o * row_bytes(2, i), dtype=np.uint8)
    s = (rng.random(o) * 0.05 + 0.01).astype(np.float32)
    return QTensor(2, i, o, 0, w, s)


def f32_tensor(rng: np.random.Generator, i: int, o: int) -> QTensor:
    w = (rng.standard_normal((o, i)) * 0.3).astype(np.float32)
    return QTensor(0, i, o, 0, w.view(np.uint8).reshape(-1), np.zeros(0, np.float32))


def upload(w: WorkerClient, t: QTensor):
    scales = t.scales if t.fmt else None
    return w.upload(
        t.weights.reshape(t.out_features, -1),
        scales,
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
    )


@dataclass
class Model:
    experts: list  # (gate, up, down) TensorRefs
    tensors: list  # (gate, up, down) QTensors
    kv_b: object
    o_proj: object
    kv_b_t: QTensor
    o_proj_t: QTensor
    mat: object  # fmt 0 [D, D]
    mat_t: QTensor


def routed_reference(m: Model, x, routes, weights) -> np.ndarray:
    """sum_j w[t, j] * expert_mlp(x[t]) from the float64 reference, expert by expert."""
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(routes.shape[1]):
            g, u, d = m.tensors[routes[t, j]]
            y[t] += weights[t, j] * ref.expert_mlp(g, u, d, x[t : t + 1])[0]
    return y


ATT = dict(q_dim=Q, rope_dim=R, v_dim=V, scale=1.0 / np.sqrt(Q + R))


def routing(rng, t, k, n):
    routes = np.stack([rng.choice(n, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    return routes, rng.random((t, k)).astype(np.float32)


def check_results_equal_unary(client: WorkerClient, model: Model, session, rng) -> None:
    """Every hot call through ``session`` gives bit-for-bit what the unary call gives."""
    m = model
    x = rng.standard_normal((5, D)).astype(np.float32)
    np.testing.assert_array_equal(session.matmul_sync(m.mat, x), client.matmul(m.mat, x))
    g, u, d = m.experts[0]
    np.testing.assert_array_equal(
        session.expert_mlp_sync(g, u, d, x), client.expert_mlp(g, u, d, x)
    )
    rows = [2, 1, 2]
    np.testing.assert_array_equal(
        session.expert_group_sync(m.experts[:3], rows, x),
        client.expert_group(m.experts[:3], rows, x),
    )
    routes, w = routing(rng, 5, 3, len(m.experts))
    np.testing.assert_array_equal(
        session.expert_group_routed_sync(m.experts, x, routes, w),
        client.expert_group_routed(m.experts, x, routes, w),
    )
    q = rng.standard_normal((3, H, Q + R)).astype(np.float32)
    lat = rng.standard_normal((7, K)).astype(np.float32)
    rope = rng.standard_normal((7, R)).astype(np.float32)
    np.testing.assert_array_equal(
        session.attention_sync(m.kv_b, q, lat, rope, o_proj=m.o_proj, **ATT),
        client.attention(m.kv_b, q, lat, rope, o_proj=m.o_proj, **ATT),
    )
    sid_a, sid_b = (int(v) for v in rng.integers(1, 1 << 40, size=2))
    seqs = [(sid_a, 0, lat[:4], rope[:4]), (sid_b, 0, lat[:6], rope[:6])]
    q2 = q[:2]
    fut = session.attention_ragged(m.kv_b, m.o_proj, q2, sequences=seqs, **ATT)
    got = fut.result(10)
    assert fut.lengths == [4, 6] and fut.backend_ns > 0
    client.free_sequence(sid_a)
    client.free_sequence(sid_b)
    want = client.attention_ragged(m.kv_b, m.o_proj, q2, sequences=seqs, **ATT)
    np.testing.assert_array_equal(got, want)
    client.free_sequence(sid_a)
    client.free_sequence(sid_b)


def check_ragged_order(client: WorkerClient, model: Model, session, rng) -> None:
    """Appends to one sequence submitted back to back (no waiting) run in order."""
    n = 12
    lat = rng.standard_normal((n, K)).astype(np.float32)
    rope = rng.standard_normal((n, R)).astype(np.float32)
    qs = rng.standard_normal((n, 1, H, Q + R)).astype(np.float32)
    sid = int(rng.integers(1, 1 << 40))
    futs = [
        session.attention_ragged(
            model.kv_b,
            model.o_proj,
            qs[i],
            sequences=[(sid, i, lat[i : i + 1], rope[i : i + 1])],
            **ATT,
        )
        for i in range(n)
    ]
    outs = [f.result(10) for f in futs]
    assert [f.lengths for f in futs] == [[i + 1] for i in range(n)]
    for i in range(n):
        want = ref.attention(
            model.kv_b_t, model.o_proj_t, qs[i], lat[: i + 1], rope[: i + 1], **ATT
        )
        assert outs[i].shape == (1, D_OUT)
        np.testing.assert_allclose(outs[i], want, rtol=1e-4, atol=1e-5)
    client.free_sequence(sid)
