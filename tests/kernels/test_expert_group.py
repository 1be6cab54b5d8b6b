"""The expert-group ops (kernels/expert_group.py) through CupyBackend against the float64
reference (GPU), and, on any machine, the streamed tables and the routed plan against a
definition written out pair by pair. The pipelined prefill path (kernels/expert_group_pipe.py):
tests/kernels/test_expert_group_pipe.py."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import REL_TOL, TC_TOL, Res, Spec, make_tensor, place_experts, rel_err

from coliworker.kernels import group_tables as gt
from coliworker.kernels import reference
from coliworker.kernels.group_tables import SMALL_ROUTES, route_plan


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(0, 0), (1, 0), (2, 0), (3, 0), (4, 64), (4, 5)])
def test_expert_group_issue_is_bit_identical(cupy_backend, rng, fmt, gs):
    b = cupy_backend
    host, dev = place_experts(b, rng, 5, 96, 40, fmt, gs)
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
    host, dev = place_experts(b, rng, 8, 6144, 2048, fmt, gs)
    x = np.repeat(rng.standard_normal((1, 6144)).astype(np.float32), 8, axis=0)
    res = b.expert_group(dev, [1] * 8, x)
    assert rel_err(res.out, reference.expert_group(host, [1] * 8, x)) < REL_TOL
    kern = min(b.expert_group(dev, [1] * 8, x).phases.kernel_ns for _ in range(20))
    print(f"GLM-5.2 decode 8x1 fmt {fmt}: kernel {kern / 1e3:.1f} us")


@pytest.mark.gpu
def test_expert_group_routed(cupy_backend, rng):
    b = cupy_backend
    host, dev = place_experts(b, rng, 6, 64, 48, 4, 32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    routes = rng.integers(0, 6, (5, 3)).astype(np.int32)
    w = rng.random((5, 3)).astype(np.float32)
    res = b.expert_group_routed(dev, x, routes, w)
    assert rel_err(res.out, reference.expert_group_routed(host, x, routes, w)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_one_token_route_order_is_bit_identical(cupy_backend, rng, monkeypatch, fmt, gs):
    """A one-token group of K other experts runs them in route order (expert_group._one_token):
    the bits of route_plan's ascending order (ROUTE_ORDER off), and within TC_TOL of float64;
    graphs on (kept plans replayed) and the first calls of each plan."""
    from coliworker.kernels import expert_group as eg

    b = cupy_backend
    d, ie, n = 512, 128, 12
    host, dev = place_experts(b, rng, n, d, ie, fmt, gs)
    for i in range(10):
        k = (8, 8, 1, 5)[i % 4]
        routes = rng.permutation(n)[:k].astype(np.int32).reshape(1, k)
        x = rng.standard_normal((1, d)).astype(np.float32)
        w = rng.random((1, k)).astype(np.float32)
        monkeypatch.setattr(eg, "ROUTE_ORDER", True)
        got = b.expert_group_routed(dev, x, routes, w).out
        monkeypatch.setattr(eg, "ROUTE_ORDER", False)
        ref_bits = b.expert_group_routed(dev, x, routes, w).out
        assert np.array_equal(got.view(np.uint32), ref_bits.view(np.uint32)), (i, routes)
        assert rel_err(got, reference.expert_group_routed(host, x, routes, w)) < TC_TOL, i


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [False, True])
def test_other_experts_of_one_shape(cupy_backend, rng, monkeypatch, routed):
    """Calls whose experts change from call to call (a decode token's routed experts) reuse
    the arena's plan by group shape (group_tables.group_shape: the tables copied in, these
    experts' addresses patched in): every call matches float64, and gives the bits of the same
    call planned afresh; graphs on and off, and with gemv_st's streamed tables."""
    from coliworker.kernels import gemv_stream as st

    b = cupy_backend
    d, ie = 4096, 256  # K >= 4096: the streamed form takes 2-4 rows where STREAM is on
    host, dev = place_experts(b, rng, 7, d, ie, 2, 0)
    for stream in ("auto", True, False):
        monkeypatch.setattr(st, "STREAM", stream)
        for k in range(8):
            sel = [int(i) for i in rng.permutation(7)[:4]]
            hs, ds = [host[i] for i in sel], [dev[i] for i in sel]
            if routed:
                x = rng.standard_normal((1, d)).astype(np.float32)
                args = (x, np.array([rng.permutation(4)], np.int32),
                        rng.random((1, 4)).astype(np.float32))  # fmt: skip
                call, ref = b.expert_group_routed, reference.expert_group_routed(hs, *args)
            else:
                rows = [int(r) for r in rng.integers(1, 4, 4)] if k % 2 else [2] * 4
                x = rng.standard_normal((sum(rows), d)).astype(np.float32)
                args = (rows, x)
                call, ref = b.expert_group, reference.expert_group(hs, rows, x)
            got = call(ds, *args).out
            assert rel_err(got, ref) < TC_TOL, (stream, k)
            for a in b._arenas(0):
                a.forget()  # planned afresh: the tables written whole for these experts
            fresh = call(ds, *args).out
            assert np.array_equal(got.view(np.uint32), fresh.view(np.uint32)), (stream, k)
        shapes = [key for a in b._arenas(0) for key in a.plans if key[0] == "group shape"]
        assert shapes, "no plan kept by group shape"


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
    host, dev = place_experts(b, rng, len(rows), 1024, 512, fmt, gs)
    x = rng.standard_normal((sum(rows), 1024)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [2, 1, 4, 3]])
def test_tensor_core_expert_group_matches_both_paths(cupy_backend, rng, fmt, gs, rows):
    b = cupy_backend
    host, dev = place_experts(b, rng, len(rows), 2048 + 64, 640, fmt, gs)
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
@pytest.mark.parametrize(
    "fmt,gs,q8", [(2, 0, False), (2, 0, True), (4, 64, False), (4, 64, True), (4, 128, False)]
)
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [2, 1, 4, 3, 1]])
@pytest.mark.parametrize("d,ie", [(6144, 2048), (2048 + 64, 640)])
def test_streamed_expert_group(cupy_backend, rng, monkeypatch, fmt, gs, q8, rows, d, ie):
    # gemv_stream.STREAM: groups of up to 4 rows per expert (fmt 2, fmt 4 with power of two
    # group sizes) as two gemv_st launches (gate and up, then down), against float64 and the moe
    # path; routed (one token's 8 experts read one x row in place) likewise. q8: gemv_st's
    # integer path (gemv_stream.ST_Q8, fmt 2).
    from coliworker.kernels import gemv_stream

    monkeypatch.setattr(gemv_stream, "ST_Q8", q8)

    b = cupy_backend
    host, dev = place_experts(b, rng, len(rows), d, ie, fmt, gs)
    x = rng.standard_normal((sum(rows), d)).astype(np.float32)
    ref = reference.expert_group(host, rows, x)
    moe = b.expert_group(dev, rows, x).out
    monkeypatch.setattr(gemv_stream, "STREAM", True)
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
    gs, ds, g4 = Spec(2), Spec(2), Spec(4)
    d, ie, dout = 512, 96, 512
    ex = [(Res(gs, ie, 1 << 20 | c << 8), Res(gs, ie, 2 << 20 | c << 8),
           Res(ds, dout, 3 << 20 | c << 8)) for c in range(3)]  # fmt: skip
    ex.append((Res(g4, ie, 4 << 20), Res(g4, ie, 5 << 20), Res(Spec(4), dout, 6 << 20)))
    rows = [1, 3, 2, 4]
    plan = gt.plan_group(ex, rows)
    buf = np.full(plan.table_bytes + 64, 0xAB, np.uint8)
    seen = []

    def stream(gu, dn, max_rows):
        seen.append((gu, dn, max_rows))
        return gu is gs

    x_ptr, y_ptr, h_ptr = 0x10000, 0x20000, 0x30000
    lns = gt.write_group(buf, 16, plan, ex, d, dout, x_ptr, y_ptr, h_ptr, 0, None, stream)
    assert seen == [(gs, ds, 3), (g4, ex[3][2].spec, 4)]
    assert [ln[0] for ln in lns] == ["gemv", "gemv", "moe"]
    (_, s1, o1, n1, r1, m1, dual), (_, s2, o2, n2, r2, m2), moe = lns
    assert (s1, n1, r1, m1, dual, s2, n2, r2, m2) == (gs, 3, 3, ie, True, ds, 3, 3, dout)
    assert moe[1:3] == (g4, ex[3][2].spec) and moe[4] == 1
    jobs = gt.GEMV_JOB.dtype
    a = buf[16 + o1 : 16 + o1 + 3 * gt.GEMV_JOB.size].view(jobs)
    b = buf[16 + o2 : 16 + o2 + 3 * gt.GEMV_JOB.size].view(jobs)
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
    assert 16 + o2 + 3 * gt.GEMV_JOB.size <= 16 + moe[3]  # no table over another
    assert 16 + moe[3] + gt.counter_bytes(1) + gt.MOE_JOB.size <= 16 + plan.table_bytes


@pytest.mark.parametrize("streamed", [False, True])
def test_patch_gives_the_tables_of_other_experts(rng, streamed):
    # Tables written for experts A, then patched with experts B of the same shape (specs,
    # widths), are byte for byte the tables written for B; two fused combinations (one
    # streamed where the predicate says so), random addresses, rows of several sizes.
    gs, ds, g4, d4 = Spec(2), Spec(2), Spec(4), Spec(4)
    d, ie, dout = 512, 96, 512

    def experts():
        def res(spec, out):
            return Res(spec, out, int(rng.integers(1, 1 << 40)) * 256)

        ex = [(res(gs, ie), res(gs, ie), res(ds, dout)) for _ in range(3)]
        return ex + [(res(g4, ie), res(g4, ie), res(d4, dout)) for _ in range(2)]

    a, b = experts(), experts()

    def shape(ex):
        return gt.group_shape(gt.triples_of(ex))

    assert shape(a) == shape(b)
    assert shape(a) != shape([*a[:4], (a[4][0], a[4][1], Res(d4, 64, 0))])
    rows = [1, 3, 2, 1, 2]
    plan = gt.plan_group(a, rows)
    stream = (lambda gu, dn, m: gu is gs) if streamed else None
    ptrs = (0x10000, 0x20000, 0x30000, 0x40000)
    bufs, slots = [], []
    for ex in (a, b):
        buf = np.full(plan.table_bytes + 32, 0xAB, np.uint8)
        slots = []
        gt.write_group(buf, 32, plan, ex, d, dout, *ptrs, None, stream, slots)
        bufs.append(buf)
    assert len(slots) == (3 * 2 + 2 if streamed else 5)
    n = plan.table_bytes
    assert not np.array_equal(bufs[0], bufs[1])
    # A's tables made B's (TablePatch.fill written over a copy), and B's made A's
    for own, other, want in ((bufs[0], b, bufs[1]), (bufs[1], a, bufs[0])):
        patched = own.copy()
        tp = gt.TablePatch(own[32 : 32 + n].tobytes(), slots)
        patched[32 : 32 + n] = np.frombuffer(tp.fill(gt.triples_of(other)), np.uint8)
        assert np.array_equal(patched, want)


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


def test_one_token_takes_k_other_experts_only(monkeypatch):
    from coliworker.kernels import expert_group as eg

    assert eg._one_token(np.array([[5, 1, 7]], np.int32)) == [5, 1, 7]
    assert eg._one_token(np.array([[5, 1, 5]], np.int32)) is None  # a repeated expert
    monkeypatch.setattr(eg, "ROUTE_ORDER", False)
    assert eg._one_token(np.array([[5, 1, 7]], np.int32)) is None


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
