"""The server tests' client: a WorkerClient on the module's ``server`` fixture."""

from __future__ import annotations

import pytest

from coliworker.client import WorkerClient


@pytest.fixture
def w(server):
    with WorkerClient(server.address, timeout=60, progress=False) as client:
        yield client
