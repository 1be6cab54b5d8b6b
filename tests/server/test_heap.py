"""server/heap.py: the collection keeper freezes what is tracked, a settle collects the garbage
frozen with it (when the worker is quiet after calls, or at the latest after ``longest``), and
the last keeper to stop hands the objects back to the collector."""

from __future__ import annotations

import gc
import weakref

import pytest

from coliworker.server import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def _garbage() -> weakref.ref:
    """A garbage cycle, tracked and young; a weak reference tells whether it still lives."""
    node = _Node()
    ref = weakref.ref(node)
    del node
    return ref


@pytest.fixture
def keeper(monkeypatch):
    """A keeper whose thread never ticks (the test turns it by ``step``), its last call at
    the test's hand (``calls``), none other running."""
    monkeypatch.setattr(heap, "ENABLED", True)
    monkeypatch.setattr(heap, "_running", 0)
    calls = [0.0]
    k = heap.Keeper(lambda: calls[0], interval=3600, quiet=5, longest=600)
    k.calls = calls
    k.start()
    yield k
    k.stop()
    gc.unfreeze()


def test_a_step_freezes_and_the_collector_skips_what_is_frozen(keeper):
    ref = _garbage()
    keeper.step(keeper._settled + 1)  # no call since: a freeze
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach


def test_a_settle_when_quiet_after_calls_collects_the_frozen_garbage(keeper):
    ref = _garbage()
    t = keeper._settled
    keeper.step(t + 1)
    keeper.calls[0] = t + 2  # a call, then quiet
    keeper.step(t + 2 + 4.9)  # not quiet long enough: a freeze
    assert ref() is not None and keeper.settles == 0
    keeper.step(t + 2 + 5)
    assert ref() is None and keeper.settles == 1
    assert gc.get_freeze_count() > 0  # what lives is frozen again
    ref2 = _garbage()
    keeper.step(t + 100)  # quiet, but no call since the settle: a freeze only
    assert keeper.settles == 1 and ref2() is not None


def test_a_busy_worker_settles_after_longest(keeper):
    ref = _garbage()
    t = keeper._settled
    keeper.calls[0] = t + 599
    keeper.step(t + 599.5)  # busy, not yet longest: a freeze
    assert ref() is not None and keeper.settles == 0
    keeper.calls[0] = t + 600
    keeper.step(t + 600)
    assert ref() is None and keeper.settles == 1


def test_the_last_keeper_to_stop_unfreezes(keeper):
    other = heap.Keeper(lambda: 0.0, interval=3600).start()
    keeper.step(keeper._settled + 1)
    other.stop()
    assert gc.get_freeze_count() > 0  # one keeper still runs
    keeper.stop()
    assert gc.get_freeze_count() == 0
    keeper.stop()  # (again: nothing)


def test_switched_off_the_keeper_starts_no_thread(monkeypatch):
    monkeypatch.setattr(heap, "ENABLED", False)
    k = heap.Keeper(lambda: 0.0).start()
    assert k._thread is None
    k.stop()


def test_a_worker_runs_its_keeper_while_it_serves(monkeypatch):
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    monkeypatch.setattr(heap, "ENABLED", True)
    srv = build_server(Config(backend="numpy", port=0, data_port=None)).start()
    try:
        assert srv.heap._thread is not None and srv.heap._thread.is_alive()
        before = srv.servicer.dispatch.last
        from coliworker.client import WorkerClient

        with WorkerClient(srv.address, progress=False) as w:
            w.info()
        assert srv.servicer.dispatch.last > before  # the keeper sees the call
    finally:
        srv.stop(0)
    assert srv.heap._thread is None
