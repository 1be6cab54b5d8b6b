"""TensorUsage: per-tensor calls and rows of the caller's resident tensors, counted by every
compute call, dropped on free, filtered by device, ranked; and its top-N metrics."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from _rel import TOKENS, Mla, random_tensor, serve, token_env, upload

from coliworker.client import WorkerClient
from coliworker.server.metrics import Metrics
from coliworker.server.usage import UsageCounts
from coliworker.v1 import worker_pb2 as pb


@pytest.fixture
def worker():
    s = serve()
    yield s
    s.stop(None)


@pytest.fixture
def w(worker):
    with WorkerClient(worker.address, progress=False) as c:
        yield c


def usage(w: WorkerClient, **request) -> dict[int, tuple[int, int, int]]:
    r = w._call(w._stub.TensorUsage, pb.TensorUsageRequest(**{"device": -1, **request}))
    return {t.handle: (t.device, t.calls, t.rows) for t in r.tensors}


def expert(w, rng, device=0):
    return tuple(
        upload(w, random_tensor(rng, 2, i, o), device) for i, o in ((16, 12), (16, 12), (12, 16))
    )


def test_every_compute_call_counts_its_tensors(w, rng) -> None:
    t = upload(w, random_tensor(rng, 2, 16, 8))
    e0, e1, e2 = expert(w, rng), expert(w, rng), expert(w, rng)
    m = Mla()
    kv, o = (upload(w, a) for a in m.tensors(rng))
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w.matmul(t, x[:3])
    w.matmul(t, x)
    w.expert_mlp(*e2, x[:2])
    w.expert_group([e0, e1], [2, 3], x)
    w.expert_group_async([e0], [1], x[:1]).result()
    routes = np.array([[0, 1], [1, 1], [1, 0], [0, 1]], np.int32)  # e2 gets no token
    w.expert_group_routed([e0, e1, e2], x[:4], routes, np.ones((4, 2), np.float32))
    lat, rop = m.rows(rng, 3)
    w.attention(kv, m.q(rng, 3), lat, rop, **m.dims())  # no o_proj
    w.attention_ragged(kv, o, m.q(rng, 2), sequences=[(1, 0, lat, rop), (2, 0, lat, rop)],
                       **m.dims())  # fmt: skip
    got = usage(w)
    assert got[t.handle] == (0, 2, 8)
    for h in e0:  # group (2 rows), issue (1 row), routed (3 (token, slot) pairs)
        assert got[h.handle] == (0, 3, 6)
    for h in e1:  # group (3 rows), routed (5 pairs)
        assert got[h.handle] == (0, 2, 8)
    for h in e2:  # expert_mlp only: the routed call sent it no token
        assert got[h.handle] == (0, 1, 2)
    assert got[kv.handle] == (0, 2, 5)
    assert got[o.handle] == (0, 1, 2)
    ranked = list(usage(w, top=3))
    assert len(ranked) == 3 and ranked[0] in {h.handle for h in e0}


def test_free_drops_counts_and_device_filters(w, rng) -> None:
    a = upload(w, random_tensor(rng, 2, 16, 8), device=0)
    b = upload(w, random_tensor(rng, 2, 16, 8), device=1)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    w.matmul(a, x)
    w.matmul(b, x)
    assert set(usage(w, device=1)) == {b.handle}
    assert usage(w)[a.handle] == (0, 1, 2)
    w.free(a)
    fresh = upload(w, random_tensor(rng, 2, 16, 8))
    assert a.handle not in usage(w) and usage(w)[fresh.handle] == (0, 0, 0)


def test_unknown_device_names_the_field(w) -> None:
    with pytest.raises(Exception) as info:
        usage(w, device=7)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor_usage.device" in info.value.message and "got 7" in info.value.message


def test_owners_see_their_own_tensors_only(rng) -> None:
    s = serve(tokens=token_env())
    try:
        with (
            WorkerClient(s.address, token=TOKENS["alice"]) as alice,
            WorkerClient(s.address, token=TOKENS["bob"]) as bob,
        ):
            a = upload(alice, random_tensor(rng, 2, 16, 8))
            alice.matmul(a, rng.standard_normal((1, 16)).astype(np.float32))
            assert set(usage(alice)) == {a.handle}
            assert usage(bob) == {}
    finally:
        s.stop(None)


def test_counts_stay_bounded() -> None:
    live = {1, 2}
    c = UsageCounts(live=lambda: live, limit=2)
    c.tensor(0, 1, 1)
    c.tensor(0, 1, 2)
    c.tensor(0, 1, 3)  # full of live handles: not counted
    assert len(c) == 2 and c.untracked == 1
    live.discard(1)  # freed while a call ran: pruned when room is needed
    c.tensor(0, 4, 3)
    assert len(c) == 2 and c.of([(3, 0)]) == [(3, 0, 1, 4)]


def test_top_metrics_have_rank_labels_only() -> None:
    m = Metrics("0.1.0", "numpy")
    c = UsageCounts()
    m.bind_usage(c.top)
    for h in range(1, 30):
        c.tensor(h % 2, h, h)
    text = m.render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("coliworker_tensor_top_calls{")]
    assert len(lines) == 20  # 10 ranks x 2 devices, whatever the number of tensors
    assert 'coliworker_tensor_top_rows{device="1",rank="1"} 29.0' in text


def test_counts_recorded_on_many_threads_while_read_lose_nothing(rng) -> None:
    """Recording appends to a journal without a lock; reads and full journals fold it."""
    import threading

    from coliworker.server import usage as usage_mod

    c = UsageCounts()
    triples = ((1, 2, 3), (4, 5, 6), (7, 8, 9))
    routes = [rng.integers(0, 3, size=(int(rng.integers(1, 4)), 2)).astype(np.int32)
              for _ in range(4)]  # fmt: skip
    n_calls = 3 * usage_mod.JOURNAL  # past the journal's length: recording folds too
    per_set = 3 * (n_calls // 4) // 4  # three threads, each cycling over the four sets
    want_calls, want_rows = [0] * 3, [0] * 3
    for r in routes:
        n = np.bincount(r.ravel(), minlength=3)
        for e in range(3):
            want_calls[e] += per_set * int(n[e] > 0)
            want_rows[e] += per_set * int(n[e])

    def record(k: int) -> None:
        for i in range(n_calls // 4):
            r = routes[(k + i) % 4].copy()
            c.routed(0, triples, r)
            r[:] = -1  # the caller's array changes after recording: counts do not
            c.tensor(1, 2, 10, 0)

    def read(stop: threading.Event) -> None:
        while not stop.is_set():
            c.of([(1, 0)])

    stop = threading.Event()
    reader = threading.Thread(target=read, args=(stop,))
    reader.start()
    threads = [threading.Thread(target=record, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    reader.join(60)
    got = {h: (calls, rows) for h, _, calls, rows in c.of([(h, 0) for h in range(1, 11)])}
    for e, triple in enumerate(triples):
        for h in triple:
            assert got[h] == (want_calls[e], want_rows[e]), (h, e)
    assert got[10] == (3 * (n_calls // 4), 3 * (n_calls // 4) * 2)
    # every handle recorded is counted: handle 10 and each routed expert's three (random
    # routes may leave an expert out of all four sets: it is then never recorded)
    assert c.untracked == 0 and len(c) == 1 + 3 * sum(calls > 0 for calls in want_calls)


def test_group_counts_match_a_call_by_call_count() -> None:
    """Expert groups and routed groups of several expert lists, mixed in one journal (rows of
    0, routes of 1..9 tokens), against counting each call by itself: an expert gets a call
    from each group call that gave it rows, and those rows."""
    rng = np.random.default_rng()
    c = UsageCounts()
    lists = [tuple(tuple(int(h) for h in rng.integers(1, 1 << 62, 3)) for _ in range(k))
             for k in (1, 3, 8)]  # fmt: skip
    want: dict[int, list[int]] = {}
    for _ in range(int(rng.integers(50, 300))):
        experts = lists[int(rng.integers(len(lists)))]
        k = len(experts)
        if rng.random() < 0.5:
            rows = rng.integers(0, 3, k)
            c.experts(0, experts, rows if rng.random() < 0.5 else rows.tolist())
        else:
            routes = rng.integers(0, k, (int(rng.integers(1, 10)), 2)).astype(np.int32)
            c.routed(0, experts, routes)
            rows = np.bincount(routes.ravel(), minlength=k)
        for triple, r in zip(experts, rows.tolist(), strict=True):
            for h in triple:
                w = want.setdefault(h, [0, 0])
                w[0] += r > 0
                w[1] += r
    handles = [(h, 0) for h in want]
    got = {h: (calls, rows) for h, _, calls, rows in c.of(handles)}
    assert got == {h: (w[0], w[1]) for h, w in want.items()}
