"""CUDA graph replay (kernels/graphs.py) against direct launches, to the bit, for every op.

Each test drives the same call shape several times with fresh inputs: the first call of a
shape in an arena runs direct, the second is captured, the later ones replay. The same call
with graphs off is the reference, bit for bit, and the arena must hold a captured graph
afterwards (else the test would compare direct with direct). GPU only.
"""

from __future__ import annotations

import numpy as np
import pytest
from _kern import make_tensor

pytestmark = pytest.mark.gpu

CALLS = 4  # direct, captured, replayed, replayed


@pytest.fixture
def backend(cupy_backend):
    return cupy_backend


@pytest.fixture
def graphs(monkeypatch):
    """Set graphs on or off for the next calls."""
    from coliworker.kernels import graphs as cupy_graphs

    def switch(on: bool) -> None:
        monkeypatch.setattr(cupy_graphs, "ENABLED", on)

    return switch


@pytest.fixture(params=["python", "compiled"])
def kept_path(request, backend, monkeypatch):
    """The kept decode calls run by their Python twins, or compiled (``server/kept.c``;
    skipped where it is not built)."""
    if request.param == "python":
        monkeypatch.setattr(backend, "_compiled", None)
    elif backend._compiled is None:
        pytest.skip("server/kept.c is not built here (server/kept.py logged why)")
    return request.param


def count_kept(backend, monkeypatch, op: str, hits: list) -> None:
    """Append to ``hits``, for each kept call of ``op`` ("routed", "ragged" or "matmul"),
    whether it was made without a ``Call``, on the path the backend runs (``kept_path``)."""
    from coliworker.kernels import attention_call, expert_group, matmul

    mod, name = {
        "routed": (expert_group, "routed_kept"),
        "ragged": (attention_call, "run_kept"),
        "matmul": (matmul, "run_kept"),
    }[op]

    def counted(fn):
        def kept(*args):
            got = fn(*args)
            hits.append(got is not None)
            return got

        return kept

    c = backend._compiled
    if c is None:
        monkeypatch.setattr(mod, name, counted(getattr(mod, name)))
    else:
        monkeypatch.setattr(backend, "_compiled", c._replace(**{op: counted(getattr(c, op))}))


def _replayed(backend) -> int:
    """Graphs captured in this thread's arenas of device 0."""
    return sum(sum(e is not None for e in a.graphs.execs.values()) for a in backend._arenas(0))


def _same(fn, graphs, inputs) -> None:
    """fn(inp) with graphs off and on, every input, equal to the bit."""
    for inp in inputs:
        graphs(False)
        want = fn(inp).out
        graphs(True)
        got = fn(inp).out
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _graph_then_direct(backend, fn, graphs, inputs) -> None:
    """Run every input with graphs on first (capturing), then compare with graphs off."""
    graphs(True)
    got = [fn(inp).out for inp in inputs]
    assert _replayed(backend) > 0, "no call shape was captured"
    graphs(False)
    for inp, g in zip(inputs, got, strict=True):
        want = fn(inp).out
        assert np.array_equal(g.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt,gs,s", [(2, 0, 1), (2, 0, 4), (4, 64, 1), (0, 0, 2), (4, 128, 8)])
def test_matmul(backend, rng, graphs, fmt, gs, s):
    t = make_tensor(rng, fmt, 96, 200 if fmt == 0 else 256, gs)
    r = backend.place(t, 0)
    xs = [rng.standard_normal((s, t.in_features)).astype(np.float32) for _ in range(CALLS)]
    _graph_then_direct(backend, lambda x: backend.matmul(r, x), graphs, xs)


@pytest.mark.parametrize("fmt,gs,rows", [(2, 0, 1), (2, 0, 4), (4, 64, 1), (2, 0, 40)])
def test_expert_group(backend, rng, graphs, fmt, gs, rows):
    d, i, n = 256, 128, 6
    experts = [
        tuple(
            backend.place(t, 0)
            for t in (
                make_tensor(rng, fmt, i, d, gs),
                make_tensor(rng, fmt, i, d, gs),
                make_tensor(rng, fmt, d, i, gs),
            )
        )
        for _ in range(n)
    ]
    rl = [rows] * n
    xs = [rng.standard_normal((rows * n, d)).astype(np.float32) for _ in range(CALLS)]
    _graph_then_direct(backend, lambda x: backend.expert_group(experts, rl, x), graphs, xs)
    # issue / take: an outstanding group owns its arena, replayed the same way
    graphs(True)
    pend = [backend.expert_group_issue(experts, rl, x) for x in xs]
    got = [p.result().out for p in pend]
    graphs(False)
    for x, g in zip(xs, got, strict=True):
        assert np.array_equal(g, backend.expert_group(experts, rl, x).out)
    # lend (the data plane's compiled path): the kept call's out is its arena's own view, the
    # same bits as the owned copy, until this thread's next call writes its output there
    graphs(True)
    owned = [backend.expert_group(experts, rl, x).out for x in xs]
    lent = [backend.expert_group(experts, rl, x, True).out for x in xs]
    last = lent[-1].copy()
    assert np.array_equal(last, owned[-1]) and not lent[-1].flags.owndata
    assert all(np.shares_memory(a, lent[-1]) for a in lent[-3:])  # (kept from the third on)
    assert np.array_equal(backend.expert_group(experts, rl, xs[0], True).out, owned[0])
    assert np.array_equal(lent[-1], owned[0])  # the next call's output, in the same place


@pytest.mark.parametrize("tokens,k", [(1, 4), (5, 3)])
def test_expert_group_routed(backend, rng, graphs, tokens, k):
    d, i, n = 256, 128, 6
    experts = [
        tuple(
            backend.place(t, 0)
            for t in (
                make_tensor(rng, 2, i, d),
                make_tensor(rng, 2, i, d),
                make_tensor(rng, 2, d, i),
            )
        )
        for _ in range(n)
    ]
    routes = np.stack([rng.permutation(n)[:k] for _ in range(tokens)]).astype(np.int32)
    ins = [
        (
            rng.standard_normal((tokens, d)).astype(np.float32),
            rng.random((tokens, k)).astype(np.float32),
        )
        for _ in range(CALLS)
    ]

    def call(inp):
        x, w = inp
        return backend.expert_group_routed(experts, x, routes, w)

    _graph_then_direct(backend, call, graphs, ins)


def test_attention_ragged(backend, rng, graphs):
    h, q, r, v, k, dout, t0 = 8, 32, 16, 32, 128, 96, 300
    kv_b = backend.place(make_tensor(rng, 2, h * (q + v), k), 0)
    o_proj = backend.place(make_tensor(rng, 2, dout, h * v), 0)
    scale = 1 / np.sqrt(q + r)
    seqs = 3
    # Twin caches: one driven with graphs off, one with graphs on, the same rows.
    twins = []
    for _ in range(2):
        twins.append([backend.new_kv(0, k, r) for _ in range(seqs)])
    base = [
        (
            rng.standard_normal((t0, k)).astype(np.float32),
            rng.standard_normal((t0, r)).astype(np.float32),
        )
        for _ in range(seqs)
    ]
    for caches in twins:
        for c, (la, ro) in zip(caches, base, strict=True):
            c.append(la, ro)
    for _ in range(CALLS + 1):
        qs = rng.standard_normal((seqs, h, q + r)).astype(np.float32)
        rows = [
            (
                rng.standard_normal((1, k)).astype(np.float32),
                rng.standard_normal((1, r)).astype(np.float32),
            )
            for _ in range(seqs)
        ]
        outs = []
        for on, caches in zip((False, True), twins, strict=True):
            graphs(on)
            for c in caches:
                c.reserve(1)
            outs.append(
                backend.attention_ragged(kv_b, o_proj, qs, caches, q, r, v, scale, rows=rows).out
            )
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert _replayed(backend) > 0
    for caches in twins:
        for c in caches:
            c.release()


def test_attention_batch(backend, rng, graphs):
    h, q, r, v, k, t = 8, 32, 16, 32, 128, 40
    kv_b = backend.place(make_tensor(rng, 2, h * (q + v), k), 0)
    scale = 1 / np.sqrt(q + r)
    ins = [
        (
            rng.standard_normal((2, h, q + r)).astype(np.float32),
            rng.standard_normal((t, k)).astype(np.float32),
            rng.standard_normal((t, r)).astype(np.float32),
        )
        for _ in range(CALLS)
    ]

    def call(inp):
        qs, lat, rope = inp
        return backend.attention(kv_b, None, qs, lat, rope, q, r, v, scale)

    _graph_then_direct(backend, call, graphs, ins)


def test_a_call_shape_whose_capture_fails_stays_direct(backend, rng, graphs, monkeypatch):
    from coliworker.kernels import graphs as cupy_graphs

    monkeypatch.setattr(cupy_graphs.Graphs, "_capture", staticmethod(lambda *a: None))
    t = make_tensor(rng, 2, 64, 128)
    w = backend.place(t, 0)
    xs = [rng.standard_normal((1, 128)).astype(np.float32) for _ in range(CALLS)]
    _same(lambda x: backend.matmul(w, x), graphs, xs)
    assert _replayed(backend) == 0


def test_a_kept_plan_replays_its_graph(backend, rng, graphs, monkeypatch, kept_path):
    """Calls of a kept plan launch the plan's graph once it is captured, with no work listed:
    routed groups naming other experts of one shape each call (the shape's plan, its tables
    patched) and dense matmuls, both made without a ``Call`` (``expert_group.routed_kept``, or
    compiled; ``matmul.run_kept``), to the bit of the same calls with graphs off."""
    from coliworker.server.cupy_calls import Call

    replayed: list[bool] = []
    real = Call.replay

    def counting(self, rep):
        done = real(self, rep)
        replayed.append(done)
        return done

    monkeypatch.setattr(Call, "replay", counting)
    count_kept(backend, monkeypatch, "routed", replayed)
    count_kept(backend, monkeypatch, "matmul", replayed)
    d, i, pool = 256, 128, 12
    experts = [
        tuple(backend.place(make_tensor(rng, 2, *io), 0) for io in ((i, d), (i, d), (d, i)))
        for _ in range(pool)
    ]
    routes = np.arange(4, dtype=np.int32).reshape(1, 4)
    w = backend.place(make_tensor(rng, 2, d, 160), 0)
    for n in range(2 * CALLS):
        sel = [experts[(3 * n + j) % pool] for j in range(4)]  # other experts every call
        x = rng.standard_normal((1, d)).astype(np.float32)
        wt = rng.random((1, 4)).astype(np.float32)
        xm = rng.standard_normal((1, d)).astype(np.float32)
        outs = []
        for on in (True, False):
            graphs(on)
            outs.append((backend.expert_group_routed(sel, x, routes, wt).out,
                         backend.matmul(w, xm).out))  # fmt: skip
        for got, want in zip(*outs, strict=True):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # Two ops, each direct, captured, then made without a Call for every later call.
    assert sum(replayed) == 2 * (2 * CALLS - 2)


def test_a_kept_ragged_attention_plan_runs_without_a_call(
    backend, rng, graphs, monkeypatch, kept_path
):
    """Ragged attention calls of a kept plan (one shape, the cache's length the same on every
    call) are made without a ``Call`` once the plan's graph is captured
    (``attention_call.run_kept``, or compiled), to the bit of the same calls with graphs off."""
    hits: list[bool] = []
    count_kept(backend, monkeypatch, "ragged", hits)
    h, q, r, v, k, dout, t0 = 8, 32, 16, 32, 128, 96, 300
    kv_b = backend.place(make_tensor(rng, 2, h * (q + v), k), 0)
    o_proj = backend.place(make_tensor(rng, 2, dout, h * v), 0)
    cache = backend.new_kv(0, k, r)
    cache.append(rng.standard_normal((t0, k)).astype(np.float32),
                 rng.standard_normal((t0, r)).astype(np.float32))  # fmt: skip
    for _ in range(2 * CALLS):
        qs = rng.standard_normal((1, h, q + r)).astype(np.float32)
        outs = []
        for on in (True, False):
            graphs(on)
            outs.append(backend.attention_ragged(kv_b, o_proj, qs, [cache], q, r, v, 0.1).out)
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    # direct, captured, then made without a Call for every later call with graphs on
    assert sum(hits) == 2 * CALLS - 2
    cache.release()
