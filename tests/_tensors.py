"""The random quantized tensors the RPC tests upload (tests/server, tests/reliability,
tests/pool), their weights and scales as the client sends them, and the error measure against
the float64 reference. Importable from every test folder: pytest puts tests/ on the path for
tests/conftest.py."""

from __future__ import annotations

import numpy as np

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


def upload(w, t: QTensor, device: int = 0):
    """``t`` uploaded through client ``w`` (any client with ``upload``); its handle."""
    return w.upload(
        *host_arrays(t),
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
        group_size=t.group_size,
        device=device,
    )
