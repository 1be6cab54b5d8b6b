"""``SequenceStore.prepare``'s decode fast path (``_resident``) decides as the general path
(``_prepare``) does: over random ragged calls on two stores in the same state, one through
``prepare``, one through ``_prepare`` only, the same caches (rows and capacity), the same
refusals (type and message), evictions, LRU order, quota and budget accounting."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from coliworker.server import sequences
from coliworker.server.backend_numpy import KV_PAGE_ROWS, NumpyBackend
from coliworker.server.errors import WorkerError
from coliworker.server.quota import Quota
from coliworker.server.sequences import RowsIn, SequenceStore
from coliworker.server.store import Budget, Handle, Spec, TensorData

K, R = 4, 2
PAGE = KV_PAGE_ROWS * (K + R) * 4  # bytes of one page of KV rows
DEVICES = (0, 1)


class _Clock:
    """time.monotonic as a counter: each store's LRU order is exact, ties only within a call."""

    def __init__(self) -> None:
        self._n = itertools.count(1)

    def monotonic(self) -> float:
        return float(next(self._n))


def _store(limit_pages: int, quota_pages: int) -> tuple[SequenceStore, list[int]]:
    evicted: list[int] = []
    store = SequenceStore(
        NumpyBackend(DEVICES),
        Budget(DEVICES, limit_pages * PAGE),
        max_rows=5 * KV_PAGE_ROWS,
        on_evict=evicted.append,
        quota=Quota(quota_pages * PAGE),
    )
    return store, evicted


def _state(store: SequenceStore, evicted: list[int]) -> dict:
    seqs = store._seqs
    return {
        "caches": {
            key: (q.cache.length, q.cache.nbytes, q.device, q.k, q.r) for key, q in seqs.items()
        },
        "lru": sorted(seqs, key=lambda key: (seqs[key].last_used, key)),
        "evicted": list(store._evicted),
        "on_evict": list(evicted),
        "quota": dict(store.quota._used),
        "budget": dict(store.budget.used),
        "turns": len(store._turns),
    }


def _outcome(fn, *args) -> tuple[str, object]:
    try:
        return "ok", [(c.length, c.nbytes) for c in fn(*args)]
    except WorkerError as exc:
        return type(exc).__name__, str(exc)


def _general(store: SequenceStore):
    """``prepare`` as it is without its fast path."""

    def prepare(kv_b, rows, k, r):
        with store.lock:
            return store._prepare(kv_b, rows, k, r)

    return prepare


@pytest.mark.parametrize(("limit_pages", "quota_pages"), [(7, 9), (0, 0), (3, 0), (0, 4)])
def test_prepare_fast_path_decides_as_the_general_path(monkeypatch, limit_pages, quota_pages):
    monkeypatch.setattr(sequences, "time", _Clock())
    rnd = random.Random(1000 * limit_pages + quota_pages)
    fast, fast_evicted = _store(limit_pages, quota_pages)
    slow, slow_evicted = _store(limit_pages, quota_pages)
    handles = [
        Handle(1 + i, owner, TensorData(Spec(0, K, 8, 0, DEVICES[i % 2]), b"", None, 0))
        for i, owner in enumerate(["a", "a", "b"])
    ]
    hits = [0, 0]  # prepare calls the fast path decided, left to the general path
    resident = fast._resident

    def counted(*args):
        caches = resident(*args)
        hits[caches is None] += 1
        return caches

    fast._resident = counted  # type: ignore[method-assign]
    charged: list[tuple[str, str | int, int]] = []  # over-limit charges to take back later
    for _ in range(2000):
        kv_b = rnd.choice(handles)
        ids = rnd.sample(range(4), rnd.choice([1, 1, 1, 2, 3]))
        lengths = fast.lengths(kv_b, ids)
        assert lengths == slow.lengths(kv_b, ids)
        k, r = (K, R) if rnd.random() > 0.03 else rnd.choice([(K + 1, R), (K, R + 1)])
        rows = []
        for sid, n in zip(ids, lengths, strict=True):
            start = rnd.choice([n] * 8 + [max(0, n - rnd.randint(1, 5)), n + 1, 0])
            new = rnd.choice([1] * 6 + [0, 2, rnd.randint(0, 3 * KV_PAGE_ROWS)])
            lat = np.full((new, k), float(sid), np.float32)
            rows.append(RowsIn(sid, start, lat, np.zeros((new, r), np.float32)))
        got = _outcome(fast.prepare, kv_b, rows, k, r)
        want = _outcome(_general(slow), kv_b, rows, k, r)
        assert got == want
        if got[0] == "ok" and rnd.random() < 0.8:  # the attention call claims the rows
            for store in (fast, slow):
                for s, n in zip(rows, store.lengths(kv_b, ids), strict=True):
                    seq = store._seqs[(kv_b.owner, kv_b.id, s.sequence_id)]
                    assert seq.cache.length == n == s.start
                    seq.cache.append(s.latent, s.rope)
        event = rnd.random()
        if event < 0.03:  # a free
            owner, sid = rnd.choice("ab"), rnd.randrange(4)
            assert fast.free(owner, sid, None) == slow.free(owner, sid, None)
        elif event < 0.04 and quota_pages:  # an owner over its quota (tensor bytes, say)
            owner = rnd.choice("ab")
            charged.append(("quota", owner, quota_pages * PAGE))
            for store in (fast, slow):
                store.quota.charge(owner, quota_pages * PAGE)
        elif event < 0.05 and limit_pages:  # a device over its budget
            device = rnd.choice(DEVICES)
            charged.append(("budget", device, limit_pages * PAGE))
            for store in (fast, slow):
                store.budget.charge(device, limit_pages * PAGE)
        elif event < 0.15 and charged:
            what, who, nbytes = charged.pop(rnd.randrange(len(charged)))
            for store in (fast, slow):
                if what == "quota":
                    store.quota.discharge(who, nbytes)
                else:
                    store.budget.release(who, nbytes)
        assert _state(fast, fast_evicted) == _state(slow, slow_evicted)
    assert min(hits) > 200, hits  # both paths ran, often
    if limit_pages:
        assert fast_evicted, "no eviction happened"
