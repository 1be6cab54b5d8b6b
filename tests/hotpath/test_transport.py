"""Unix domain socket, half-precision wire types, chunked large activations."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from _hotpath import D, f32_tensor, upload

from coliworker.client import WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.config import Config

# Documented bound (README, hot path): for a linear op with wire dtype of unit roundoff u
# (float16 2^-11, bfloat16 2^-8), |y - y_exact| <= u * sum_i |W[o, i] x[i]| + u * |y|,
# plus the float32 rounding of the computation itself.
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def test_unix_socket(model, rng):
    path = os.path.join(tempfile.mkdtemp(), "w.sock")
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None, unix_socket=path))
    srv.start()
    try:
        with WorkerClient(f"unix:{path}") as w:
            t = upload(w, f32_tensor(rng, D, 7))
            x = rng.standard_normal((3, D)).astype(np.float32)
            y = w.matmul(t, x)
            with w.session(transport="grpc") as s:
                np.testing.assert_array_equal(s.matmul_sync(t, x), y)
            with w.session(shm=True) as s:
                np.testing.assert_array_equal(s.matmul_sync(t, x), y)
    finally:
        srv.stop(0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_wire_error_within_bound(server, model, rng, dtype):
    u = UNIT[dtype]
    x = rng.standard_normal((9, D)).astype(np.float32)
    w64 = model.mat_t.weights.view(np.float32).reshape(D, D).astype(np.float64)
    exact = x.astype(np.float64) @ w64.T
    bound = u * (np.abs(x) @ np.abs(w64).T) + u * np.abs(exact) + 1e-6 * np.abs(exact) + 1e-7
    with WorkerClient(server.address, wire_dtype=dtype) as w:
        for y in (w.matmul(model.mat, x), w.session(transport="grpc").matmul_sync(model.mat, x)):
            assert y.dtype == np.float32
            assert np.all(np.abs(y - exact) <= bound)
            assert np.max(np.abs(y - exact)) > 0  # it did round
        # nonlinear ops: the L2 relative error stays within a few u
        xr = rng.standard_normal((4, D)).astype(np.float32)
        routes = np.array([[0, 1], [2, 3], [4, 5], [1, 3]], np.int32)
        wts = rng.random((4, 2)).astype(np.float32)
        with w.session(transport="grpc") as s:
            y = s.expert_group_routed_sync(model.experts, xr, routes, wts)
        want = np.asarray(ref.expert_group_routed(model.tensors, xr, routes, wts), np.float64)
        assert np.linalg.norm(y - want) <= 8 * u * np.linalg.norm(want)


@pytest.mark.slow
def test_50mb_activation_batch_is_chunked(rng):
    """A 50 MB batch through a worker and client that accept at most 4 MiB per message."""
    limit = 4 << 20
    srv = build_server(
        Config(backend="numpy", port=0, metrics_port=None, max_message_bytes=limit)
    ).start()
    try:
        with WorkerClient(srv.address, max_message_bytes=limit, timeout=120) as w:
            t = f32_tensor(rng, 64, 64)
            ref_t = upload(w, t)
            x = rng.standard_normal((50 * 1024 * 1024 // 256, 64)).astype(np.float32)
            assert x.nbytes >= 50 << 20
            want = ref.matmul(t, x)
            with w.session(transport="grpc") as s:
                y = s.matmul_sync(ref_t, x)
            np.testing.assert_array_equal(y, want)
            with w.session(shm=True, shm_bytes=128 << 20) as s:
                y = s.matmul_sync(ref_t, x)
            np.testing.assert_array_equal(y, want)
    finally:
        srv.stop(0)
