"""The reliability suite's workers: a subprocess on a fixed port that tests kill and restart
(``worker``), and the data-plane frame tests' checked in-process worker (``plane``)."""

from __future__ import annotations

import pytest
from _rel import WorkerProcess


@pytest.fixture
def worker():
    p = WorkerProcess().start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def plane():
    """The frame tests' worker (``_frames.Plane``), checked unchanged after the module."""
    from _frames import Plane

    p = Plane()
    yield p
    p.check()
    p.close()
