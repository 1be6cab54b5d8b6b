"""The reliability suite's worker: a subprocess on a fixed port that tests kill and restart."""

from __future__ import annotations

import pytest
from _rel import WorkerProcess


@pytest.fixture
def worker():
    p = WorkerProcess().start()
    yield p
    p.stop()
