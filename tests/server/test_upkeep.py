"""server/upkeep.py: the upkeep folds the journals in pieces, oldest first, letting other threads
run between pieces; it freezes what is tracked, a settle collects the garbage frozen with it
(when the worker is quiet after calls, or at the latest after ``longest``), and the last
upkeep to stop hands the objects back to the collector."""

from __future__ import annotations

import gc
import weakref

import pytest

from coliworker.server import upkeep


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
    """An upkeep whose thread never ticks (the test turns it by ``step``), its last call at
    the test's hand (``calls``), none other freezing."""
    monkeypatch.setattr(upkeep, "FREEZE", True)
    monkeypatch.setattr(upkeep, "_freezing", 0)
    calls = [0.0]
    k = upkeep.Upkeep(lambda: calls[0], interval=3600, quiet=5, longest=600, tick=3600)
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
    other = upkeep.Upkeep(lambda: 0.0, interval=3600, tick=3600).start()
    keeper.step(keeper._settled + 1)
    other.stop()
    assert gc.get_freeze_count() > 0  # one keeper still runs
    keeper.stop()
    assert gc.get_freeze_count() == 0
    keeper.stop()  # (again: nothing)


def test_with_nothing_to_do_no_thread_starts(monkeypatch):
    monkeypatch.setattr(upkeep, "FREEZE", False)
    k = upkeep.Upkeep(lambda: 0.0).start()  # no folds, no freezing
    assert k._thread is None
    k.stop()
    monkeypatch.setattr(upkeep, "FOLD_AHEAD", False)
    k = upkeep.Upkeep(lambda: 0.0, [lambda most: 0]).start()
    assert k._thread is None and not k.folds


def test_a_fold_applies_every_journal_in_pieces_oldest_first(monkeypatch):
    """Each fold function is asked for PIECE entries at a time until none gives any (at
    most PIECES times), the GIL let go between pieces; what they apply is in order."""
    from coliworker.server.tally import Tally

    monkeypatch.setattr(upkeep, "FREEZE", False)
    applied: list[list[int]] = [[], []]
    tally = Tally()
    journals = [tally.journal(applied[0].extend), tally.journal(applied[1].extend)]
    for i in range(3 * upkeep.PIECE + 5):
        journals[0].record(i)
    for i in range(7):
        journals[1].record(i)
    asked: list[int] = []

    def fold(most: int) -> int:
        asked.append(most)
        return tally.fold(most)

    sleeps: list[float] = []
    monkeypatch.setattr(upkeep.time, "sleep", sleeps.append)
    upkeep.Upkeep(lambda: 0.0, [fold]).fold()
    assert applied == [list(range(3 * upkeep.PIECE + 5)), list(range(7))]
    assert asked == [upkeep.PIECE] * 5  # four pieces, then one that finds none
    assert sleeps == [0] * 4


def test_a_worker_runs_its_upkeep_while_it_serves(monkeypatch):
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    monkeypatch.setattr(upkeep, "FREEZE", True)
    srv = build_server(Config(backend="numpy", port=0, metrics_port=0, data_port=None)).start()
    try:
        k = srv.upkeep
        assert k._thread is not None and k._thread.is_alive()
        assert k.folds == (srv.servicer.tensor_counts.fold, srv.metrics.tally.fold)
        before = srv.servicer.dispatch.last
        from coliworker.client import WorkerClient

        with WorkerClient(srv.address, progress=False) as w:
            w.info()
        assert srv.servicer.dispatch.last > before  # the keeper sees the call
    finally:
        srv.stop(0)
    assert srv.upkeep._thread is None
