"""Fixtures of the hot-path tests: a worker on port 0 and small resident experts/attention."""

from __future__ import annotations

import numpy as np
import pytest
from _hotpath import D_OUT, I_E, D, H, K, Model, Q, V, f32_tensor, int4_tensor, upload

from coliworker.client import WorkerClient
from coliworker.server.app import build_server
from coliworker.server.config import Config


@pytest.fixture(scope="module")
def server():
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def client(server):
    with WorkerClient(server.address) as w:
        yield w


@pytest.fixture(scope="module")
def model(client) -> Model:
    rng = np.random.default_rng()
    tensors = [
        (int4_tensor(rng, D, I_E), int4_tensor(rng, D, I_E), int4_tensor(rng, I_E, D))
        for _ in range(6)
    ]
    experts = [tuple(upload(client, t) for t in triple) for triple in tensors]
    kv_b_t = int4_tensor(rng, K, H * (Q + V))
    o_proj_t = int4_tensor(rng, H * V, D_OUT)
    mat_t = f32_tensor(rng, D, D)
    return Model(
        experts,
        tensors,
        upload(client, kv_b_t),
        upload(client, o_proj_t),
        kv_b_t,
        o_proj_t,
        upload(client, mat_t),
        mat_t,
    )
