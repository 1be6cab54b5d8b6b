"""Shared by the kernel tests: random quantized tensors, expert groups of them placed on a
backend, stand-ins for residents (host-only table tests), the error measure and tolerances."""

from __future__ import annotations

import numpy as np

from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count

REL_TOL = 1e-3
TC_TOL = 1e-5  # the tensor-core path keeps fp32 activations (3-way bf16 split): ~1e-7 seen


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def make_tensor(rng: np.random.Generator, fmt: int, o: int, i: int, gs: int = 0) -> QTensor:
    if fmt == 0:
        w = rng.standard_normal((o, i)).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        w = rng.integers(0, 256, o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.02 + 0.005).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


FMT_GS = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 64), (4, 128), (4, 3), (4, 5), (4, 6)]


def row_rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    """Worst over rows of max|y - ref| / max|ref| (rows may differ in scale)."""
    worst = 0.0
    for k in range(ref.shape[0]):
        den = max(float(np.abs(ref[k]).max()), 1e-30)
        worst = max(worst, float(np.abs(y[k] - ref[k]).max()) / den)
    return worst


def place_experts(b, rng: np.random.Generator, n: int, d: int, ie: int, fmt: int, gs: int):
    """n random experts (gate and up [ie, d], down [d, ie]) on the host and placed on b's
    device 0: (host triples, device triples)."""
    host = [
        tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
        for _ in range(n)
    ]
    dev = [tuple(b.place(t, 0) for t in e) for e in host]
    return host, dev


class Spec:
    """A weight spec's stand-in (specs compare by identity) for the host-only table tests."""

    def __init__(self, fmt: int) -> None:
        self.fmt = fmt


class Res:
    """A resident's stand-in: spec, fmt, out_features and two fake device pointers."""

    def __init__(self, spec: Spec, out: int, ptr: int) -> None:
        self.spec, self.fmt, self.out_features, self.ptrs = spec, spec.fmt, out, (ptr, ptr + 8)
