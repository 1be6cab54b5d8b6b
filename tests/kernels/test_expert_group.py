"""The expert-group ops (kernels/expert_group.py) through CupyBackend against the float64
reference (GPU), the pipelined prefill path against the one-launch path to the bit (GPU), and,
on any machine, the routed plan against a definition written out pair by pair and the
pipelined path's runs, pieces and tables against the one table."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from bisect import bisect_left
from fractions import Fraction
from itertools import accumulate
from types import SimpleNamespace

import numpy as np
import pytest
from _kern import REL_TOL, TC_TOL, make_tensor, rel_err

from coliworker.kernels import expert_group as eg
from coliworker.kernels import reference
from coliworker.kernels.expert_group import SMALL_ROUTES, route_plan


def _experts(b, rng, n, d, ie, fmt, gs):
    host = [
        tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
        for _ in range(n)
    ]
    dev = [tuple(b.place(t, 0) for t in e) for e in host]
    return host, dev


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(0, 0), (1, 0), (2, 0), (3, 0), (4, 64), (4, 5)])
def test_expert_group_issue_is_bit_identical(cupy_backend, rng, fmt, gs):
    b = cupy_backend
    host, dev = _experts(b, rng, 5, 96, 40, fmt, gs)
    rows = [1, 3, 9, 1, 2]
    x = rng.standard_normal((sum(rows), 96)).astype(np.float32)
    ref = reference.expert_group(host, rows, x)
    p1 = b.expert_group_issue(dev, rows, x)
    p2 = b.expert_group_issue(dev, rows, -x)
    mid = b.expert_group(dev, rows, 2 * x)  # a sync call between issue and result
    r1, r2 = p1.result(), p2.result()
    assert rel_err(r1.out, ref) < REL_TOL
    assert np.array_equal(r1.out, b.expert_group(dev, rows, x).out)
    assert np.array_equal(r2.out, b.expert_group(dev, rows, -x).out)
    assert rel_err(mid.out, reference.expert_group(host, rows, 2 * x)) < REL_TOL
    assert r1.phases.kernel_ns > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_expert_group_glm52_decode(cupy_backend, rng, fmt, gs):
    b = cupy_backend
    host, dev = _experts(b, rng, 8, 6144, 2048, fmt, gs)
    x = np.repeat(rng.standard_normal((1, 6144)).astype(np.float32), 8, axis=0)
    res = b.expert_group(dev, [1] * 8, x)
    assert rel_err(res.out, reference.expert_group(host, [1] * 8, x)) < REL_TOL
    kern = min(b.expert_group(dev, [1] * 8, x).phases.kernel_ns for _ in range(20))
    print(f"GLM-5.2 decode 8x1 fmt {fmt}: kernel {kern / 1e3:.1f} us")


@pytest.mark.gpu
def test_expert_group_routed(cupy_backend, rng):
    b = cupy_backend
    host, dev = _experts(b, rng, 6, 64, 48, 4, 32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    routes = rng.integers(0, 6, (5, 3)).astype(np.int32)
    w = rng.random((5, 3)).astype(np.float32)
    res = b.expert_group_routed(dev, x, routes, w)
    assert rel_err(res.out, reference.expert_group_routed(host, x, routes, w)) < REL_TOL


# Gate, up and down of one expert may each have their own format and group size: such experts
# run unfused (gate and up separately), beside fused ones in the same group.
MIXED = [((4, 1, 3), (5, 0, 0)), ((0, 1, 3), (0, 0, 0)), ((2, 4, 2), (0, 64, 0)),
         ((4, 4, 4), (64, 32, 64)), ((2, 2, 4), (0, 0, 32))]  # fmt: skip


def _mixed_expert(b, rng, d, ie, fmts, gss):
    host = tuple(
        make_tensor(rng, f, *sh, gs)
        for f, gs, sh in zip(fmts, gss, ((ie, d), (ie, d), (d, ie)), strict=True)
    )
    return host, tuple(b.place(t, 0) for t in host)


@pytest.mark.gpu
@pytest.mark.parametrize("fmts,gss", MIXED)
def test_expert_mlp_mixed_formats(cupy_backend, rng, fmts, gss):
    b = cupy_backend
    host, dev = _mixed_expert(b, rng, 200, 72, fmts, gss)
    x = rng.standard_normal((3, 200)).astype(np.float32)
    res = b.expert_mlp(*dev, x)
    assert rel_err(res.out, reference.expert_mlp(*host, x)) < REL_TOL


@pytest.mark.gpu
def test_expert_group_and_routed_mixed_formats(cupy_backend, rng):
    b = cupy_backend
    d, ie = 256, 96
    pairs = [_mixed_expert(b, rng, d, ie, f, g) for f, g in MIXED + [((2, 2, 2), (0, 0, 0))]]
    host = [h for h, _ in pairs]
    dev = [dv for _, dv in pairs]
    rows = [1, 4, 2, 9, 1, 3]
    x = rng.standard_normal((sum(rows), d)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < REL_TOL
    p = b.expert_group_issue(dev, rows, x)
    assert np.array_equal(p.result().out, res.out)
    xt = rng.standard_normal((7, d)).astype(np.float32)
    routes = rng.integers(0, len(dev), (7, 4)).astype(np.int32)
    w = rng.random((7, 4)).astype(np.float32)
    got = b.expert_group_routed(dev, xt, routes, w)
    assert rel_err(got.out, reference.expert_group_routed(host, xt, routes, w)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (1, 0)])
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [32, 1, 17, 8, 5, 2, 40, 3]])
def test_expert_group_fused_rows(cupy_backend, rng, fmt, gs, rows):
    # The one-launch path at a GLM-like width (many tiles per expert, several row tiles).
    b = cupy_backend
    host, dev = _experts(b, rng, len(rows), 1024, 512, fmt, gs)
    x = rng.standard_normal((sum(rows), 1024)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [2, 1, 4, 3]])
def test_tensor_core_expert_group_matches_both_paths(cupy_backend, rng, fmt, gs, rows):
    b = cupy_backend
    host, dev = _experts(b, rng, len(rows), 2048 + 64, 640, fmt, gs)
    x = rng.standard_normal((sum(rows), 2048 + 64)).astype(np.float32)
    ref = reference.expert_group(host, rows, x)
    tc = b.expert_group(dev, rows, x).out
    assert rel_err(tc, ref) < TC_TOL
    assert np.array_equal(tc, b.expert_group(dev, rows, x).out)  # same bits every call
    from coliworker.kernels import matmul

    matmul.TENSOR_CORES = False
    try:
        fp32 = b.expert_group(dev, rows, x).out
    finally:
        matmul.TENSOR_CORES = True
    assert rel_err(fp32, ref) < TC_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128)])
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [2, 1, 4, 3, 1]])
@pytest.mark.parametrize("d,ie", [(6144, 2048), (2048 + 64, 640)])
def test_streamed_expert_group(cupy_backend, rng, monkeypatch, fmt, gs, rows, d, ie):
    # matmul.STREAM: groups of up to 4 rows per expert (fmt 2, fmt 4 with power of two group
    # sizes) as two gemv_st launches (gate and up, then down), against float64 and the moe
    # path; routed (one token's 8 experts read one x row in place) likewise.
    from coliworker.kernels import matmul

    b = cupy_backend
    host, dev = _experts(b, rng, len(rows), d, ie, fmt, gs)
    x = rng.standard_normal((sum(rows), d)).astype(np.float32)
    ref = reference.expert_group(host, rows, x)
    moe = b.expert_group(dev, rows, x).out
    monkeypatch.setattr(matmul, "STREAM", True)
    got = b.expert_group(dev, rows, x).out
    assert rel_err(got, ref) < TC_TOL and rel_err(moe, ref) < TC_TOL
    assert np.array_equal(got, b.expert_group(dev, rows, x).out)  # same bits every call
    assert np.array_equal(got, b.expert_group_issue(dev, rows, x).result().out)
    xt = rng.standard_normal((1, d)).astype(np.float32)
    routes = rng.permutation(len(rows))[None, : min(8, len(rows))].astype(np.int32)
    w = rng.random(routes.shape).astype(np.float32)
    r = b.expert_group_routed(dev, xt, routes, w).out
    assert rel_err(r, reference.expert_group_routed(host, xt, routes, w)) < TC_TOL


def test_streamed_tables():
    # write_group with a stream predicate that says yes: per fused expert one dual gemv job
    # (gate and up pointers, x rows -> hidden rows) and one down job (hidden -> y rows), two
    # launches; it says no for the other combination, which keeps its moe table.
    gs, ds, g4 = _Spec(2), _Spec(2), _Spec(4)
    d, ie, dout = 512, 96, 512
    ex = [(_Res(gs, ie, 1 << 20 | c << 8), _Res(gs, ie, 2 << 20 | c << 8),
           _Res(ds, dout, 3 << 20 | c << 8)) for c in range(3)]  # fmt: skip
    ex.append((_Res(g4, ie, 4 << 20), _Res(g4, ie, 5 << 20), _Res(_Spec(4), dout, 6 << 20)))
    rows = [1, 3, 2, 4]
    plan = eg.plan_group(ex, rows)
    buf = np.full(plan.table_bytes + 64, 0xAB, np.uint8)
    seen = []

    def stream(gu, dn, max_rows):
        seen.append((gu, dn, max_rows))
        return gu is gs

    x_ptr, y_ptr, h_ptr = 0x10000, 0x20000, 0x30000
    lns = eg.write_group(buf, 16, plan, ex, d, dout, x_ptr, y_ptr, h_ptr, 0, None, stream)
    assert seen == [(gs, ds, 3), (g4, ex[3][2].spec, 4)]
    assert [ln[0] for ln in lns] == ["gemv", "gemv", "moe"]
    (_, s1, o1, n1, r1, m1, dual), (_, s2, o2, n2, r2, m2), moe = lns
    assert (s1, n1, r1, m1, dual, s2, n2, r2, m2) == (gs, 3, 3, ie, True, ds, 3, 3, dout)
    assert moe[1:3] == (g4, ex[3][2].spec) and moe[4] == 1
    jobs = eg.GEMV_JOB.dtype
    a = buf[16 + o1 : 16 + o1 + 3 * eg.GEMV_JOB.size].view(jobs)
    b = buf[16 + o2 : 16 + o2 + 3 * eg.GEMV_JOB.size].view(jobs)
    for c in range(3):
        g, u, dn = ex[c]
        h = h_ptr + 4 * plan.hid_off[c]
        assert tuple(a[c][["w0", "s0", "w1", "s1"]].item()) == (*g.ptrs, *u.ptrs)
        assert (a[c]["x"], a[c]["y"], a[c]["rows"], a[c]["out_rows"]) == (
            x_ptr + 4 * d * plan.row_off[c],
            h,
            rows[c],
            ie,
        )
        assert (a[c]["x_stride"], a[c]["y_stride"]) == (d, ie)
        assert tuple(b[c][["w0", "s0", "w1", "s1"]].item()) == (*dn.ptrs, 0, 0)
        assert (b[c]["x"], b[c]["y"], b[c]["rows"], b[c]["out_rows"]) == (
            h,
            y_ptr + 4 * dout * plan.row_off[c],
            rows[c],
            dout,
        )
        assert (b[c]["x_stride"], b[c]["y_stride"]) == (ie, dout)
    assert 16 + o2 + 3 * eg.GEMV_JOB.size <= 16 + moe[3]  # no table over another
    assert 16 + moe[3] + eg.counter_bytes(1) + eg.MOE_JOB.size <= 16 + plan.table_bytes


# ---- the pipelined prefill path (kernels/expert_group.py: issue_pipelined) ----

# Uneven rows per expert, 1100 in all: x is 1100 x 4096 float32 = 17.2 MiB, over PIPE_BYTES.
PIPE_ROWS = [200, 3, 97, 150, 1, 64, 33, 180, 71, 5, 120, 176]
PIPE_D, PIPE_IE = 4096, 256
PF_TOL = 1e-4  # the prefill kernel's bound (tests/kernels/test_prefill_tc.py)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture
def pipelined_calls(monkeypatch):
    """How many calls took the pipelined path (issue_pipelined), counted as they run."""
    seen = []
    real = eg.issue_pipelined

    def spy(*args, **kw):
        seen.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(eg, "issue_pipelined", spy)
    monkeypatch.setattr(eg, "PIPELINE", True)  # whatever COLIWORKER_PREFILL_PIPELINE says
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (1, 0)])
@pytest.mark.parametrize("launches,pieces", [(4, 2), (3, 1), (12, 3)])
def test_pipelined_group_is_bit_identical_to_one_launch(
    cupy_backend, rng, monkeypatch, pipelined_calls, fmt, gs, launches, pieces
):
    # fmt 2 and 4/64 take the tensor-core prefill kernel (moe_pf), fmt 1 the fp32 moe.
    b = cupy_backend
    host, dev = _experts(b, rng, len(PIPE_ROWS), PIPE_D, PIPE_IE, fmt, gs)
    monkeypatch.setattr(eg, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(eg, "PIPE_PIECES", pieces)
    limit = eg.PIPE_BYTES
    for _ in range(2):  # fresh data each time; the second call reuses the arena's streams
        x = rng.standard_normal((sum(PIPE_ROWS), PIPE_D)).astype(np.float32)
        assert 4 * x.size >= eg.PIPE_BYTES
        n = len(pipelined_calls)
        got = b.expert_group(dev, PIPE_ROWS, x)
        assert len(pipelined_calls) == n + 1
        monkeypatch.setattr(eg, "PIPE_BYTES", 1 << 62)  # the one-launch path
        want = b.expert_group(dev, PIPE_ROWS, x)
        monkeypatch.setattr(eg, "PIPE_BYTES", limit)
        assert len(pipelined_calls) == n + 1
        assert got.out.shape == want.out.shape == (sum(PIPE_ROWS), PIPE_D)
        assert np.array_equal(_bits(got.out), _bits(want.out))
        p = got.phases
        assert p.h2d_ns > 0 and p.kernel_ns > 0 and p.d2h_ns > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_pipelined_group_against_reference(cupy_backend, rng, pipelined_calls, fmt, gs):
    b = cupy_backend
    host, dev = _experts(b, rng, len(PIPE_ROWS), PIPE_D, PIPE_IE, fmt, gs)
    x = rng.standard_normal((sum(PIPE_ROWS), PIPE_D)).astype(np.float32)
    res = b.expert_group(dev, PIPE_ROWS, x)
    assert pipelined_calls
    assert rel_err(res.out, reference.expert_group(host, PIPE_ROWS, x)) < PF_TOL
    # several in flight (each its own arena and copy streams), then a sync call between
    p1 = b.expert_group_issue(dev, PIPE_ROWS, x)
    p2 = b.expert_group_issue(dev, PIPE_ROWS, -x)
    mid = b.expert_group(dev, PIPE_ROWS, 2 * x)
    assert np.array_equal(_bits(p1.result().out), _bits(res.out))
    assert np.array_equal(_bits(p2.result().out), _bits(b.expert_group(dev, PIPE_ROWS, -x).out))
    assert rel_err(mid.out, reference.expert_group(host, PIPE_ROWS, 2 * x)) < PF_TOL


def _bounds_by_definition(rows: list[int], launches: int, edge: float) -> list[int]:
    """pipe_bounds written out in exact fractions: the k-th cut is the first expert count whose
    rows reach the k-th cumulative target (shares edge, 1, ..., 1, edge of all rows), kept
    where it leaves rows on both sides; repeated cuts are one."""
    share = [Fraction(1)] * launches
    if launches > 1:
        share[0] = share[-1] = Fraction(edge)
    cum = list(accumulate(share))
    prefix = list(accumulate((int(r) for r in rows), initial=0))  # ascending
    total = prefix[-1]
    cuts = set()
    for k in range(1, launches):
        j = bisect_left(prefix, total * cum[k - 1] / cum[-1], lo=1)  # first prefix >= target
        if 0 < prefix[j] < total:
            cuts.add(j)
    return [0, *sorted(cuts), len(rows)]


@pytest.mark.parametrize("edge", [1.0, 0.5, 0.25, 0.3])
def test_pipe_bounds_cut_by_rows(edge):
    rng = np.random.default_rng()
    cases = [PIPE_ROWS, [32] * 64, [1] * 3, [5, 0, 0, 7], [0, 0, 9, 1], [9, 0, 0], [1, 1000]]
    cases += [[0] * 5, [0], [3]]
    cases += [list(rng.integers(0, 50, rng.integers(1, 80))) for _ in range(200)]
    cases += [[int(r) * (rng.random() < 0.4) for r in rng.integers(1, 9, 40)] for _ in range(50)]
    for rows in cases:
        for launches in (1, 2, 3, 4, 8, 100):
            bounds = eg.pipe_bounds(rows, launches, edge)
            assert bounds == _bounds_by_definition(rows, launches, edge), (rows, launches)
            assert bounds[0] == 0 and bounds[-1] == len(rows)
            assert all(a < c for a, c in zip(bounds, bounds[1:], strict=False))
            assert len(bounds) - 1 <= max(1, min(launches, len(rows)))
            if sum(rows):
                assert all(sum(rows[a:c]) > 0 for a, c in zip(bounds, bounds[1:], strict=False))
            if edge == 1.0:  # the default argument is equal runs
                assert eg.pipe_bounds(rows, launches) == bounds
    if edge == 1.0:
        assert eg.pipe_bounds([32] * 64, 4) == [0, 16, 32, 48, 64]
        assert eg.pipe_bounds([32] * 64, 8) == list(range(0, 65, 8))
    if edge == 0.5:  # rows as 0.5 : 1 : 1 : 0.5, each cut at the first expert past its target
        assert eg.pipe_bounds([32] * 64, 4, edge) == [0, 11, 32, 54, 64]
        assert eg.pipe_bounds([32] * 64, 2, edge) == [0, 32, 64]  # two edges: equal still


@pytest.mark.parametrize("edge", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("launches", [3, 4, 8])
def test_pipe_bounds_edge_runs_are_shorter(edge, launches):
    """With many small experts (a cut overshoots its target by less than one expert) every
    target gets its own cut, the first and the last run are no larger than any middle one, and
    each run is its share of the rows to within the largest expert."""
    rng = np.random.default_rng()
    whole = 2 * edge + launches - 2
    for _ in range(50):
        rows = [int(r) for r in rng.integers(0, 9, rng.integers(200, 400))]
        bounds = eg.pipe_bounds(rows, launches, edge)
        run = [sum(rows[a:c]) for a, c in zip(bounds, bounds[1:], strict=False)]
        assert len(run) == launches and all(run)
        assert max(run[0], run[-1]) <= min(run[1:-1])
        share = [edge] + [1.0] * (launches - 2) + [edge]
        for r, sh in zip(run, share, strict=True):
            assert abs(r - sum(rows) * sh / whole) < max(rows)


def test_pipe_edge_from_the_environment():
    assert eg._pipe_edge(None) == 1.0
    assert eg._pipe_edge("0.5") == 0.5 and eg._pipe_edge("1") == 1.0
    for bad in ("0", "-0.5", "1.5", "nan", "inf", "", "half"):
        with pytest.raises(ValueError, match=f"COLIWORKER_PIPE_EDGE={bad!r}"):
            eg._pipe_edge(bad)
    # at import, as the worker reads it
    code = "from coliworker.kernels import expert_group as eg; print(eg.PIPE_EDGE)"
    for text, ok in (("0.25", True), ("2", False)):
        env = {**os.environ, "COLIWORKER_PIPE_EDGE": text}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if ok:
            assert r.returncode == 0 and r.stdout.strip() == text, r.stderr
        else:
            assert r.returncode != 0 and "COLIWORKER_PIPE_EDGE='2'" in r.stderr


def test_pipe_pieces_cover_each_run():
    rows = PIPE_ROWS
    off = np.concatenate([[0], np.cumsum(rows)]).tolist()
    for launches in (2, 4, 12):
        bounds = eg.pipe_bounds(rows, launches)
        for n in (1, 2, 3, 500):
            pieces = eg.pipe_pieces(off, bounds, n)
            assert pieces[0][1] == 0 and pieces[-1][2] == sum(rows)
            for (k0, _, e0), (k1, s1, _) in zip(pieces, pieces[1:], strict=False):
                assert e0 == s1 and k1 in (k0, k0 + 1)
            for k in range(len(bounds) - 1):
                mine = [(s, e) for kk, s, e in pieces if kk == k]
                assert mine[0][0] == off[bounds[k]] and mine[-1][1] == off[bounds[k + 1]]
                assert len(mine) == min(n, off[bounds[k + 1]] - off[bounds[k]])
                assert all(e > s for s, e in mine)


class _Spec:
    def __init__(self, fmt: int) -> None:
        self.fmt = fmt


class _Res:
    def __init__(self, spec: _Spec, out: int, ptr: int) -> None:
        self.spec, self.fmt, self.out_features, self.ptrs = spec, spec.fmt, out, (ptr, ptr + 8)


def _records(buf: np.ndarray, off: int, n: int) -> np.ndarray:
    p = off + eg.counter_bytes(n)
    assert not buf[off:p].any()  # the counters start at zero
    return buf[p : p + eg.MOE_JOB.size * n].copy()


@pytest.mark.parametrize("edge", [1.0, 0.5])
@pytest.mark.parametrize("launches", [2, 3, 4, 12])
def test_pipe_tables_hold_the_one_tables_jobs(monkeypatch, launches, edge):
    """Every run's job records are the one table's, byte for byte (same pointers), and every
    run's launch has the one launch's maxima (so the same kernel and tiles)."""
    gs, ds = _Spec(2), _Spec(2)
    d, ie, dout = 4096, 256, 4096
    experts = [(_Res(gs, ie, 1 << 20 | c << 8), _Res(gs, ie, 2 << 20 | c << 8),
                _Res(ds, dout, 3 << 20 | c << 8)) for c in range(len(PIPE_ROWS))]  # fmt: skip
    x = np.zeros((sum(PIPE_ROWS), d), np.float32)
    monkeypatch.setattr(eg, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(eg, "PIPE_EDGE", edge)
    pp = eg.pipe_plan(experts, PIPE_ROWS, x)
    assert pp is not None
    plan, bounds, subs = pp
    assert bounds == eg.pipe_bounds(PIPE_ROWS, launches, edge)
    assert 2 <= len(bounds) - 1 <= launches
    one = np.full(plan.table_bytes + 64, 0xAB, np.uint8)
    (ln,) = eg.write_group(one, 16, plan, experts, d, dout, 0x10000, 0x20000, 0x30000, 0)
    buf = np.full(sum(s.table_bytes for s in subs) + 64, 0xAB, np.uint8)
    runs = eg.pipe_tables(buf, 16, plan, bounds, subs, experts, d, dout, 0x10000, 0x20000,
                          0x30000)  # fmt: skip
    assert len(runs) == len(bounds) - 1
    got = np.concatenate([_records(buf, 16 + r[3], r[4]) for r in runs])
    assert np.array_equal(got, _records(one, 16 + ln[3], ln[4]))
    assert sum(r[4] for r in runs) == ln[4] == len(PIPE_ROWS)
    assert all(r[:3] == ln[:3] and r[5:] == ln[5:] for r in runs)
    # not pipelined: small, one expert, rows that are not x's, unfused experts
    assert eg.pipe_plan(experts, PIPE_ROWS, x[:100]) is None
    assert eg.pipe_plan(experts[:1], [1100], x) is None
    odd = [(experts[0][0], experts[0][1], _Res(_Spec(1), dout, 0))] + experts[1:]
    assert eg.pipe_plan(odd, PIPE_ROWS, x) is None
    monkeypatch.setattr(eg, "PIPE_BYTES", 1 << 62)
    assert eg.pipe_plan(experts, PIPE_ROWS, x) is None


class _Sim:
    """CUDA streams and events as issue_pipelined uses them, on host memory: every stream's
    work is queued and run at the end in a random order that keeps each stream's order and
    its event waits (a wait sees the event's records made before it, as in CUDA), so a
    missing dependency shows as a wrong result. Copies up read their source when issued (the
    earliest a DMA can): a copy up issued before its copy into pinned memory was done reads
    what is not there yet."""

    def __init__(self, rng: np.random.Generator, eager: bool) -> None:
        self.rng = rng
        self.eager = eager  # run the first stream made (the kernels') whenever it can
        self.queues: dict[int, list[tuple]] = {}
        self.records: dict[int, int] = {}  # event: records issued
        self.fired: dict[int, int] = {}  # event: records done

    def stream(self) -> int:
        s = len(self.queues) + 1
        self.queues[s] = []
        return s

    # cupy.cuda.runtime, the calls issue_pipelined makes
    def eventRecord(self, ev: int, s: int) -> None:
        self.records[ev] = self.records.get(ev, 0) + 1
        self.queues[s].append(("record", ev))

    def streamWaitEvent(self, s: int, ev: int, flags: int) -> None:
        self.queues[s].append(("wait", ev, self.records.get(ev, 0)))

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, s: int) -> None:
        assert kind in (eg.H2D, eg.D2H)
        data = ctypes.string_at(src, n) if kind == eg.H2D else None
        self.queues[s].append(("copy", dst, src, n, data))

    def run(self, until: int | None = None) -> None:
        """Run the queued work (to the end, or until event ``until`` has fired: a sync)."""
        while any(self.queues.values()):
            if until is not None and self.fired.get(until, 0) >= self.records[until]:
                return
            ready = [s for s, q in self.queues.items() if q and self._ready(q[0])]
            assert ready, "the streams wait on each other: deadlock"
            pick = ready[0] if self.eager else ready[self.rng.integers(len(ready))]
            op = self.queues[pick].pop(0)
            if op[0] == "record":
                self.fired[op[1]] = self.fired.get(op[1], 0) + 1
            elif op[0] == "copy":
                _, dst, src, n, data = op
                ctypes.memmove(dst, data if data is not None else src, n)
            elif op[0] == "kernel":
                op[1]()

    def _ready(self, op: tuple) -> bool:
        return op[0] != "wait" or self.fired.get(op[1], 0) >= op[2]


def _sim_kernel(d: int):
    """A fake moe launch: each job's y = x[:, :dout] * 2 + its expert (from its gate
    pointer), read through the job table; its counters must be zero."""

    def moe_launch(gu, dn, n, max_rows, max_ie, max_dout, n_sm):
        def go(jobs, ctr):
            def run():
                assert not any(ctypes.string_at(int(ctr), 4 * (1 + n)))
                for j in range(n):
                    f = eg.MOE_JOB.unpack(ctypes.string_at(int(jobs) + j * eg.MOE_JOB.size,
                                                           eg.MOE_JOB.size))  # fmt: skip
                    wg, x, y, rows, dout = f[0], f[6], f[8], f[9], f[11]
                    xs = np.frombuffer(ctypes.string_at(x, 4 * rows * d), np.float32)
                    ys = xs.reshape(rows, d)[:, :dout] * 2 + ((wg >> 8) & 0xFF)
                    ctypes.memmove(y, np.ascontiguousarray(ys, np.float32).ctypes.data, ys.nbytes)

            sim.queues[comp].append(("kernel", run))

        return go

    return moe_launch


sim: _Sim
comp: int


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("launches,pieces", [(4, 2), (3, 1), (12, 3), (2, 500)])
@pytest.mark.parametrize("edge", [1.0, 0.5])
def test_pipelined_issue_on_simulated_streams(monkeypatch, edge, direct, launches, pieces, eager):
    """issue_pipelined's copies, launches and events without a GPU (``_Sim``): every output
    row is its expert's, whatever order the streams' work runs in (random, or the kernels as
    early as their waits let them)."""
    global sim, comp
    rng = np.random.default_rng()
    d, ie, dout = 64, 40, 48
    sim = _Sim(rng, eager)
    comp = sim.stream()
    up, down = sim.stream(), sim.stream()
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=sim)))
    fake_mm = SimpleNamespace(moe_launch=_sim_kernel(d))
    monkeypatch.setitem(sys.modules, "coliworker.kernels.matmul", fake_mm)
    monkeypatch.setattr(eg, "PIPELINE", True)
    monkeypatch.setattr(eg, "PIPE_BYTES", 64 << 10)
    monkeypatch.setattr(eg, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(eg, "PIPE_PIECES", pieces)
    monkeypatch.setattr(eg, "PIPE_EDGE", edge)
    gs, ds = _Spec(2), _Spec(2)
    experts = [(_Res(gs, ie, 1 << 20 | c << 8), _Res(gs, ie, 2 << 20 | c << 8),
                _Res(ds, dout, 3 << 20 | c << 8)) for c in range(len(PIPE_ROWS))]  # fmt: skip
    x = rng.standard_normal((sum(PIPE_ROWS), d)).astype(np.float32)
    keep = []

    def reserve(dev_bytes, host_bytes):
        a = SimpleNamespace(dev=np.full(dev_bytes, 0xFF, np.uint8),
                            host=np.full(host_bytes, 0xFF, np.uint8))  # fmt: skip
        a.dptr, a.hptr = a.dev.ctypes.data, a.host.ctypes.data
        a.streams = lambda: (SimpleNamespace(ptr=up), SimpleNamespace(ptr=down))
        a.pipe_events = lambda n: list(range(100, 100 + n))
        keep.append(a)
        return a

    call = SimpleNamespace(backend=SimpleNamespace(_registered=lambda p, n: direct),
                           stream=SimpleNamespace(ptr=comp), reserve=reserve)  # fmt: skip
    eg.issue(call, experts, PIPE_ROWS, x, 132)
    assert hasattr(call, "spans"), "not pipelined"
    sim.run(until=call.done)  # finish's wait
    (a,) = keep
    off, n, shape = call.out
    y = a.host[off : off + n].view(np.float32).reshape(shape).copy()
    sim.run()
    ro = np.concatenate([[0], np.cumsum(PIPE_ROWS)])
    want = np.concatenate([x[ro[c] : ro[c + 1], :dout] * 2 + c for c in range(len(PIPE_ROWS))])
    assert np.array_equal(y, want)
    h2d, kern, d2h = call.spans
    assert len(kern) == len(d2h) == len(eg.pipe_bounds(PIPE_ROWS, launches, edge)) - 1
    assert len(h2d) >= len(kern) and call.done == d2h[-1][1]
    assert all(sim.fired.get(e) == 1 for ph in call.spans for s in ph for e in s)


# ---- the routed plan (no GPU) ----


def _expected(routes: np.ndarray, n_experts: int):
    """Packed rows by expert (ascending), within an expert by flat index (t * K + j)."""
    T, K = routes.shape
    pairs = sorted(range(T * K), key=lambda i: (int(routes.flat[i]), i))
    used = sorted({int(e) for e in routes.flat})
    rows = [int((routes == e).sum()) for e in used]
    src = [i // K for i in pairs]
    pos = [0] * (T * K)
    for p, i in enumerate(pairs):
        pos[i] = p
    x_rows: list[int] | None = []
    q = 0
    for c in rows:
        if src[q : q + c] != list(range(src[q], src[q] + c)):
            x_rows = None
            break
        x_rows.append(src[q])
        q += c
    assert all(e < n_experts for e in used)
    return used, rows, src, pos, x_rows


def _random_routes(rng, T: int, K: int, n_experts: int, distinct: bool) -> np.ndarray:
    if distinct:  # each token's K experts differ (a top-k router)
        return np.stack([rng.choice(n_experts, K, replace=False) for _ in range(T)]).astype(
            np.int32
        )
    return rng.integers(0, n_experts, size=(T, K), dtype=np.int32)


@pytest.mark.parametrize("small", [True, False, None])
@pytest.mark.parametrize(
    "T,K,E,distinct",
    [(1, 8, 8, True), (1, 8, 64, True), (1, 4, 3, False), (3, 2, 5, True), (8, 8, 64, True),
     (8, 8, 16, False), (32, 8, 256, True), (64, 1, 4, False), (200, 8, 64, True)],
)  # fmt: skip
def test_route_plan_matches_definition(T, K, E, distinct, small):
    rng = np.random.default_rng()
    for _ in range(5):
        routes = _random_routes(rng, T, K, E, distinct)
        plan = route_plan(routes, E, small)
        used, rows, src, pos, x_rows = _expected(routes, E)
        assert plan.used == used
        assert plan.rows == rows
        assert plan.src.dtype == np.int32 and plan.src.tolist() == src
        assert plan.pos.dtype == np.int32 and plan.pos.tolist() == pos
        assert plan.x_rows == x_rows


def test_one_token_reads_x_in_place():
    """At one token with distinct experts every expert's single row is token 0."""
    routes = np.array([[5, 1, 7, 2]], np.int32)
    for small in (True, False):
        plan = route_plan(routes, 8, small)
        assert plan.used == [1, 2, 5, 7]
        assert plan.rows == [1, 1, 1, 1]
        assert plan.x_rows == [0, 0, 0, 0]
        assert plan.pos.tolist() == [2, 0, 3, 1]


def test_size_picks_the_path():
    rng = np.random.default_rng()
    big = _random_routes(rng, SMALL_ROUTES // 8 + 1, 8, 64, True)
    assert big.size > SMALL_ROUTES
    a, b = route_plan(big, 64), route_plan(big, 64, small=True)
    assert a.pos.tolist() == b.pos.tolist() and a.x_rows == b.x_rows
