"""What the worker's RPC tests (test_service.py, test_service_errors.py) share: random
tensors of every format and their upload, experts and MLA weights made and uploaded, a device's
stats, and the error measure against the float64 reference."""

from __future__ import annotations

import numpy as np

from coliworker.client import WorkerClient
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count, scale_shape

TOL = 1e-5  # NumPy backend vs float64 reference, float32 results


def rel_err(y: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(y - want)) / max(float(np.max(np.abs(want))), 1e-30))


def random_tensor(rng: np.random.Generator, fmt: int, i: int, o: int, gs: int = 0) -> QTensor:
    if fmt == 0:
        w = rng.standard_normal((o, i)).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        w = rng.integers(0, 256, size=o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.05 + 0.01).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


def host_arrays(t: QTensor) -> tuple[np.ndarray, np.ndarray | None]:
    """(weights [out, row bytes], scales in their shape, or None) as the client sends them."""
    shape = scale_shape(t.fmt, t.in_features, t.out_features, t.group_size)
    return t.weights.reshape(t.out_features, -1), t.scales.reshape(shape) if shape else None


def upload(w: WorkerClient, t: QTensor, device: int = 0):
    return w.upload(
        *host_arrays(t),
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
        group_size=t.group_size,
        device=device,
    )


def device_stats(w, device=0):
    return next(d for d in w.stats() if d.device == device)


def make_expert(w, rng, d, ie, fmts=(2, 2, 2), gs=0, device=0):
    g = random_tensor(rng, fmts[0], d, ie, gs if fmts[0] == 4 else 0)
    u = random_tensor(rng, fmts[1], d, ie, gs if fmts[1] == 4 else 0)
    dn = random_tensor(rng, fmts[2], ie, d, gs if fmts[2] == 4 else 0)
    hosts = (g, u, dn)
    return hosts, tuple(upload(w, t, device) for t in hosts)


def mla(w, rng, heads=3, q=8, r=4, v=6, k=10, d_out=7, fmt=2):
    kv_b = random_tensor(rng, fmt, k, heads * (q + v))
    o_proj = random_tensor(rng, 1, heads * v, d_out)
    return (kv_b, o_proj), (upload(w, kv_b), upload(w, o_proj)), dict(q_dim=q, rope_dim=r, v_dim=v)
