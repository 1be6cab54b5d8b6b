"""Per-tensor usage counts (server/usage.py) after many group calls whose expert lists change
from call to call, as decode's routers send them, against counting each call by itself: at
every read (``of``, ``top``, ``len``), across journal folds and the pending table's limit,
with frees, on many threads, and through the servicer's TensorUsage and the top metrics."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from _service import make_expert

from coliworker.client import requests
from coliworker.server import usage
from coliworker.server.metrics import Metrics
from coliworker.server.usage import UsageCounts
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec


class Reference:
    """The counts, call by call: a tensor call counts one call of its rows on each handle;
    a group call one call of expert c's rows (routed: its (token, slot) pairs) on each of
    expert c's handles, where it has rows."""

    def __init__(self) -> None:
        self.counts: dict[int, list[int]] = {}  # handle -> [device, calls, rows]

    def _add(self, h: int, device: int, rows: int) -> None:
        c = self.counts.setdefault(h, [device, 0, 0])
        c[1] += 1
        c[2] += rows

    def tensor(self, device: int, rows: int, *handles: int) -> None:
        for h in handles:
            if h:
                self._add(h, device, rows)

    def experts(self, device: int, experts: tuple, rows) -> None:
        for triple, r in zip(experts, [int(r) for r in rows], strict=True):
            if r:
                for h in triple:
                    self._add(h, device, r)

    def routed(self, device: int, experts: tuple, routes: np.ndarray) -> None:
        self.experts(device, experts, np.bincount(routes.ravel(), minlength=len(experts)))

    def drop(self, h: int) -> None:
        self.counts.pop(h, None)

    def of(self, handles) -> list[tuple[int, int, int, int]]:
        out = []
        for h, device in handles:
            c = self.counts.get(h)
            out.append((h, device, c[1], c[2]) if c else (h, device, 0, 0))
        return sorted(out, key=lambda t: (-t[2], -t[3], t[0]))

    def top(self, n: int) -> dict[int, list[tuple[int, int]]]:
        by: dict[int, list[tuple[int, int]]] = {}
        for device, c, r in self.counts.values():
            by.setdefault(device, []).append((c, r))
        return {d: sorted(v, reverse=True)[:n] for d, v in by.items()}


def ids(rng, n: int) -> list[int]:
    """n distinct handle ids, random 63-bit numbers as the store makes them."""
    out: set[int] = set()
    while len(out) < n:
        out.add(int(rng.integers(1, 1 << 63)))
    return list(out)


def expert_pool(rng, n: int, devices=(0, 1)) -> list[tuple[int, tuple[int, int, int]]]:
    """n experts: (device, (gate, up, down) ids); a few share a gate or an up with another
    expert (a handle in two triples counts both)."""
    h = ids(rng, 3 * n)
    pool = [(devices[i % len(devices)], (h[3 * i], h[3 * i + 1], h[3 * i + 2])) for i in range(n)]
    for i in range(0, n - 2, 17):  # same device: i and i + 2
        d, (g, u, dn) = pool[i + 2]
        pool[i + 2] = (d, (pool[i][1][0], u, dn) if i % 2 else (g, pool[i][1][1], dn))
    return pool


def fresh(experts: tuple) -> tuple:
    """An equal list of new tuples and new ints, as a handler builds from a request."""
    return tuple(tuple(int(str(h)) for h in t) for t in experts)


def stream(rng, pool, calls_: int, tensors: list[int]):
    """``calls_`` random calls on ``pool``: (method, args). Mostly routed groups naming a
    new 1..8 of one device's experts in random order, sometimes one twice, sometimes a list
    sent before (the same tuple, or an equal new one); expert groups (rows 0..3, a list or
    an array); tensor calls (``tensors[i]`` on device i % 2)."""
    sent: list[tuple[int, tuple]] = []
    by_device: dict[int, list[tuple]] = {}
    for device, t in pool:
        by_device.setdefault(device, []).append(t)
    for _ in range(calls_):
        u = rng.random()
        if u < 0.1:
            device = int(rng.integers(2))
            mine_t = tensors[device::2]
            hs = [mine_t[int(i)] for i in rng.choice(len(mine_t), int(rng.integers(1, 4)))]
            if rng.random() < 0.3:
                hs.append(0)  # an absent o_proj
            yield "tensor", (device, int(rng.integers(0, 5)), *hs)
            continue
        if sent and rng.random() < 0.25:
            device, experts = sent[int(rng.integers(len(sent)))]
            if rng.random() < 0.5:
                experts = fresh(experts)
        else:
            device = int(rng.integers(2))
            mine = by_device[device]
            pick = rng.choice(len(mine), int(rng.integers(1, 9)), replace=False)
            experts = tuple(mine[int(i)] for i in pick)
            if len(experts) > 2 and rng.random() < 0.1:
                experts = (*experts[:-1], experts[0])  # one expert twice
            experts = fresh(experts)
            sent.append((device, experts))
        k = len(experts)
        if u < 0.3:
            rows = rng.integers(0, 4, k)
            yield "experts", (device, experts, rows if rng.random() < 0.5 else rows.tolist())
        else:
            routes = rng.integers(0, k, (int(rng.integers(1, 5)), int(rng.integers(1, 4))))
            yield "routed", (device, experts, routes.astype(np.int32))


def handles_of(pool, tensors: list[int]) -> list[tuple[int, int]]:
    """(handle, device) of every expert handle and tensor (tensor i on device i % 2)."""
    out = {h: d for d, t in pool for h in t}
    return list(out.items()) + [(h, i % 2) for i, h in enumerate(tensors)]


def same(c: UsageCounts, ref: Reference, handles) -> None:
    assert c.of(handles) == ref.of(handles)
    assert c.top(10) == ref.top(10)
    assert c.top(1 << 20) == ref.top(1 << 20)
    assert len(c) == len(ref.counts) and c.untracked == 0
    assert len(c._triples) <= usage.PENDING  # the pending table stays bounded


@pytest.mark.parametrize(
    ("journal", "pending"),
    [(usage.JOURNAL, usage.PENDING), (7, 12), (1, 1), (64, 100)],
    ids=["defaults", "small", "every-call", "journal-64"],
)
def test_changing_subsets_match_a_call_by_call_count(rng, monkeypatch, journal, pending):
    """Many calls on new subsets of 96 experts, read at random points and just before and
    after each journal fold: every read is the call-by-call count. With a small journal
    and pending table, folds and spreads fall between most reads."""
    monkeypatch.setattr(usage, "JOURNAL", journal)
    monkeypatch.setattr(usage, "PENDING", pending)
    pool = expert_pool(rng, 96)
    tensors = ids(rng, 6)
    handles = handles_of(pool, tensors)
    c, ref = UsageCounts(), Reference()
    n = 4 * usage.JOURNAL + int(rng.integers(100, 400)) if journal > 64 else 600
    reads = set(rng.choice(n, 12, replace=False).tolist())
    since = 0  # routed calls since the last read: the one past JOURNAL folds the journals
    for i, (method, args) in enumerate(stream(rng, pool, n, tensors)):
        getattr(c, method)(*args)
        getattr(ref, method)(*args)
        since += method == "routed"
        if i in reads or since == journal + 1:  # at random, and just after a fold
            same(c, ref, handles)
            since = 0
        if rng.random() < 0.05:  # a piece folded ahead (the upkeep's), oldest first
            c.fold(int(rng.integers(1, 20)))
    same(c, ref, handles)


def test_frees_between_calls_drop_their_counts(rng, monkeypatch):
    """A handle freed mid-stream loses its counts (those of calls still in the journal
    too); a call recorded after the free (it finished late) counts it anew."""
    monkeypatch.setattr(usage, "JOURNAL", 50)
    pool = expert_pool(rng, 40)
    tensors = ids(rng, 4)
    handles = handles_of(pool, tensors)
    c, ref = UsageCounts(), Reference()
    for i, (method, args) in enumerate(stream(rng, pool, 1500, tensors)):
        getattr(c, method)(*args)
        getattr(ref, method)(*args)
        if i % 97 == 96:
            h = handles[int(rng.integers(len(handles)))][0]
            c.drop(h)
            ref.drop(h)
        if i % 301 == 300:
            same(c, ref, handles)
    same(c, ref, handles)


@pytest.mark.parametrize("journal", [usage.JOURNAL, 5])
def test_recorded_on_many_threads_while_read(rng, monkeypatch, journal):
    """Four threads record their own streams (no lock), two read and fold pieces meanwhile:
    nothing is lost or counted twice, and no read sees a count go down or past the end."""
    monkeypatch.setattr(usage, "JOURNAL", journal)
    pool = expert_pool(rng, 64)
    tensors = ids(rng, 4)
    handles = handles_of(pool, tensors)
    c, ref = UsageCounts(), Reference()
    streams = [list(stream(rng, pool, 3 * usage.JOURNAL + 50, tensors)) for _ in range(4)]
    for s in streams:
        for method, args in s:
            getattr(ref, method)(*args)
    seen: list[list[list[tuple[int, int, int, int]]]] = [[], []]  # each reader's reads
    stop = threading.Event()

    def record(s) -> None:
        for method, args in s:
            getattr(c, method)(*args)

    def read(mine: list) -> None:
        while not stop.is_set():
            mine.append(c.of(handles))
            c.top(3)
            c.fold(5)  # and a piece folded ahead, as the upkeep does between calls

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: recording interleaves with folds
    try:
        readers = [threading.Thread(target=read, args=(mine,)) for mine in seen]
        writers = [threading.Thread(target=record, args=(s,)) for s in streams]
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join(120)
        stop.set()
        for t in readers:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    same(c, ref, handles)
    final = {h: (calls_, rows) for h, _, calls_, rows in ref.of(handles)}
    for mine in seen:
        assert mine  # each reader read meanwhile
        last: dict[int, tuple[int, int]] = {}
        for read_ in mine:
            for h, _, calls_, rows in read_:
                before = last.get(h, (0, 0))
                assert before[0] <= calls_ <= final[h][0]
                assert before[1] <= rows <= final[h][1]
                last[h] = (calls_, rows)


def test_top_metrics_are_the_call_by_call_top(rng):
    """coliworker_tensor_top_calls / _rows after changing subsets: the reference's ranks."""
    m = Metrics("0.1.0", "numpy")
    c, ref = UsageCounts(), Reference()
    m.bind_usage(c.top)
    pool = expert_pool(rng, 48)
    for method, args in stream(rng, pool, 3000, ids(rng, 3)):
        getattr(c, method)(*args)
        getattr(ref, method)(*args)
    text = m.render().decode()
    for device, ranked in ref.top(10).items():
        for rank, (calls_, rows) in enumerate(ranked, 1):
            labels = f'{{device="{device}",rank="{rank}"}}'
            assert f"coliworker_tensor_top_calls{labels} {float(calls_)}" in text
            assert f"coliworker_tensor_top_rows{labels} {float(rows)}" in text


def inline(msg, a, field, ndim):  # the unary client's encoder: every array in its message
    codec.encode_into(msg, a)


def test_tensor_usage_after_changing_routed_subsets(server, w, rng):
    """Routed and plain expert groups through the servicer, each naming a new subset of 24
    uploaded experts (some lists sent again): TensorUsage is the call-by-call count."""
    d, ie = 16, 8
    experts = [make_expert(w, rng, d, ie)[1] for _ in range(24)]
    svc = server.servicer
    ref = Reference()
    lists = []
    try:
        for i in range(300):
            if lists and i % 5 == 4:
                pick = lists[int(rng.integers(len(lists)))]
            else:
                pick = [int(j) for j in rng.choice(24, int(rng.integers(1, 9)), replace=False)]
                lists.append(pick)
            hs = [experts[j] for j in pick]
            triples = tuple((g.handle, u.handle, dn.handle) for g, u, dn in hs)
            tokens, k = int(rng.integers(1, 4)), int(rng.integers(1, 3))
            if i % 3 == 2:
                rows = [int(r) for r in rng.integers(1, 3, len(hs))]
                x = rng.standard_normal((sum(rows), d)).astype(np.float32)
                req = requests.expert_group(inline, hs, rows, x)
                out = svc.dispatch.run(calls.BY_KIND["expert_group"], req, "")
                ref.experts(0, triples, rows)
            else:
                x = rng.standard_normal((tokens, d)).astype(np.float32)
                routes = rng.integers(0, len(hs), (tokens, k)).astype(np.int32)
                weights = rng.random((tokens, k)).astype(np.float32)
                req = requests.expert_group_routed(inline, hs, x, routes, weights)
                out = svc.dispatch.run(calls.BY_KIND["expert_group_routed"], req, "")
                ref.routed(0, triples, routes)
            assert out.ok, out.message
            if i % 100 == 99:
                r = w._call(w._stub.TensorUsage, pb.TensorUsageRequest(device=-1))
                got = {t.handle: (t.device, t.calls, t.rows) for t in r.tensors}
                for triple in {(g.handle, u.handle, dn.handle) for g, u, dn in experts}:
                    for h in triple:
                        want = ref.counts.get(h, [0, 0, 0])
                        assert got[h] == (0, want[1], want[2]), h
    finally:
        for hs in experts:
            for h in hs:
                w.free(h)
    r = w._call(w._stub.TensorUsage, pb.TensorUsageRequest(device=-1))
    gone = {h.handle for hs in experts for h in hs}
    assert not gone & {t.handle for t in r.tensors}
