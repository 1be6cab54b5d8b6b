"""The server tests' worker and client: ``server``, an in-process worker on port 0 with the
NumPy backend and two virtual devices (0 and 1), one per test module (a module may define its
own: test_multi_gpu.py's runs on CuPy), and ``w``, a WorkerClient on it."""

from __future__ import annotations

import pytest

from coliworker.client import WorkerClient
from coliworker.server.app import build_server
from coliworker.server.config import Config


@pytest.fixture(scope="module")
def server():
    srv = build_server(
        Config(host="127.0.0.1", port=0, backend="numpy", devices=(0, 1), metrics_port=None)
    ).start()
    yield srv
    srv.stop(grace=None)


@pytest.fixture
def w(server):
    with WorkerClient(server.address, timeout=60, progress=False) as client:
        yield client
