"""moe_tc_f (moe_tc_fast.cuh: the decode expert group with its loads issued ahead) against moe_tc
and the float64 reference, driven through ``moe_launch`` with job tables built here, and
through the backend (CUDA graphs on and off).

moe_tc_f computes the same tiles with the same per-tile summation order as moe_tc (only its
loads, prefetches, ticket order and occupancy change), so every output must be the same bits
as moe_tc's (``matmul.MOE_TC_FAST`` off), on every call and from a replayed graph; both
within ``TC_TOL`` of float64. Shapes: GLM-5.2's decode group (8 experts, D = 6144,
I = 2048) at 1 and 4 rows and with mixed row counts, and small odd widths (outputs not a
multiple of the 32-row tile, K ending inside a step, several K tiles at four rows).
"""

from __future__ import annotations

import numpy as np
import pytest
from _kern import TC_TOL, make_tensor, rel_err, row_rel_err

from coliworker.kernels import reference

pytestmark = pytest.mark.gpu


class Group:
    """n experts (gate, up [ie, d], down [d, ie]) on the device, x [sum rows, d], one moe job
    table (int32 counters, then the MoeJob records) kept pristine on the device and copied
    into the launch's table before every call (the counters must start at zero)."""

    def __init__(self, rng, fmt: int, gs: int, d: int, ie: int, rows: list[int]):
        import cupy

        from coliworker.kernels import layout, matmul
        from coliworker.kernels.group_tables import counter_bytes
        from coliworker.kernels.records import MOE_JOB

        n = len(rows)
        self.rows, self.d, self.ie, self.n = rows, d, ie, n
        self.host = [
            tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
            for _ in range(n)
        ]
        self.gu = matmul.WeightSpec.of(fmt, d, gs)
        self.dn = matmul.WeightSpec.of(fmt, ie, gs)
        self.dev = []
        for e in self.host:
            self.dev.append(
                tuple(
                    (layout.relayout(cupy, t, cupy.asarray(t.weights)),
                     layout.scales(cupy, t, cupy.asarray(t.scales)))
                    for t in e
                )
            )  # fmt: skip
        total = sum(rows)
        self.x = cupy.zeros((total, d), cupy.float32)
        self.h = cupy.zeros(max(1, total * ie), cupy.float32)
        self.y = cupy.zeros((total, d), cupy.float32)
        cb = counter_bytes(n)
        self.jobs_off = cb
        buf = np.zeros(cb + MOE_JOB.size * n, np.uint8)
        r0 = 0
        for c, ((wg, sg), (wu, su), (wd, sd)) in enumerate(self.dev):
            MOE_JOB.pack_into(buf, cb + c * MOE_JOB.size, wg.data.ptr, sg.data.ptr, wu.data.ptr,
                              su.data.ptr, wd.data.ptr, sd.data.ptr,
                              self.x.data.ptr + 4 * r0 * d, self.h.data.ptr + 4 * r0 * ie,
                              self.y.data.ptr + 4 * r0 * d, rows[c], ie, d, 0)  # fmt: skip
            r0 += rows[c]
        self.pristine = cupy.asarray(buf)
        self.table = cupy.empty_like(self.pristine)

    def set_x(self, x: np.ndarray) -> None:
        self.xh = np.ascontiguousarray(x, np.float32)
        self.x.set(self.xh)

    def reference(self) -> np.ndarray:
        return reference.expert_group(self.host, self.rows, self.xh)

    def launch(self, fast: bool, wq: tuple[int, int] | None = None):
        """moe_tc_f (fast) or moe_tc; with ``wq`` = (S, D), moe_wq in that form where it
        serves (test_moe_wq.py), else never."""
        from coliworker.kernels import matmul

        saved = matmul.MOE_TC_FAST, matmul.MOE_WQ, matmul.WQ_SD
        matmul.MOE_TC_FAST, matmul.MOE_WQ, matmul.WQ_SD = fast, wq is not None, wq or saved[2]
        try:
            n_sm = matmul._sm_count(0)
            ln = matmul.moe_launch(self.gu, self.dn, self.n, max(self.rows), self.ie, self.d, n_sm)
        finally:
            matmul.MOE_TC_FAST, matmul.MOE_WQ, matmul.WQ_SD = saved
        assert ln is not None
        assert ln.fn is not None
        return ln

    def issue(self, ln) -> None:
        """Reset the counters (table copy) and launch, on the current stream."""
        self.table.data.copy_from_device_async(self.pristine.data, self.pristine.nbytes)
        ln(np.uint64(self.table.data.ptr + self.jobs_off), np.uint64(self.table.data.ptr))

    def run(self, ln) -> np.ndarray:
        import cupy

        self.y.fill(np.nan)  # every output must be written
        self.issue(ln)
        cupy.cuda.get_current_stream().synchronize()
        return self.y.get()


def check_both(g: Group, calls: int = 3, fallback: bool = False) -> np.ndarray:
    """Old and new path: within TC_TOL of float64, the same bits as each other and on every
    call. Returns the output. fallback: the new path is moe_tc too (fmt 4 scales too large
    for moe_tc_f's shared memory)."""
    ref = g.reference()
    old_ln, new_ln = g.launch(False), g.launch(True)
    assert (old_ln.fn is new_ln.fn) == fallback  # moe_tc and moe_tc_f, or moe_tc twice
    old = g.run(old_ln)
    new = g.run(new_ln)
    assert not np.isnan(new).any()
    assert row_rel_err(old, ref) < TC_TOL, row_rel_err(old, ref)
    assert row_rel_err(new, ref) < TC_TOL, row_rel_err(new, ref)
    assert np.array_equal(new.view(np.uint32), old.view(np.uint32)), (
        "moe_tc_f differs from moe_tc",
        float(np.abs(new - old).max()),
    )
    for _ in range(calls):
        assert np.array_equal(g.run(new_ln).view(np.uint32), new.view(np.uint32))
    return new


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128)])
def test_glm52_decode_group(rng, fmt, gs):
    # 8 experts at GLM-5.2 width: rows 1 (moe_tc_f<F, 1>), 4 and mixed (<F, 4>), on one set of
    # weights (the float64 reference dequantizes 150 MB per call).
    g = Group(rng, fmt, gs, 6144, 2048, [1] * 8)
    for rows in ([1] * 8, [4] * 8, [1, 4, 2, 3, 1, 4, 2, 1]):
        g = _rebuild(g, rows)
        g.set_x(rng.standard_normal((sum(rows), 6144)).astype(np.float32))
        check_both(g)


def _rebuild(g: Group, rows: list[int]) -> Group:
    """The same experts (weights, device copies) with another row count per expert."""
    import cupy

    from coliworker.kernels.records import MOE_JOB

    total, d, ie = sum(rows), g.d, g.ie
    g.rows = rows
    g.x = cupy.zeros((total, d), cupy.float32)
    g.h = cupy.zeros(total * ie, cupy.float32)
    g.y = cupy.zeros((total, d), cupy.float32)
    buf = g.pristine.get()
    r0 = 0
    for c, ((wg, sg), (wu, su), (wd, sd)) in enumerate(g.dev):
        MOE_JOB.pack_into(buf, g.jobs_off + c * MOE_JOB.size, wg.data.ptr, sg.data.ptr,
                          wu.data.ptr, su.data.ptr, wd.data.ptr, sd.data.ptr,
                          g.x.data.ptr + 4 * r0 * d, g.h.data.ptr + 4 * r0 * ie,
                          g.y.data.ptr + 4 * r0 * d, rows[c], ie, d, 0)  # fmt: skip
        r0 += rows[c]
    g.pristine = cupy.asarray(buf)
    g.table = cupy.empty_like(g.pristine)
    return g


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128), (4, 48)])
@pytest.mark.parametrize(
    "d,ie,rows",
    [
        (200, 72, [1] * 8),  # one step of K (d < 1024: one block), outputs not a tile multiple
        (1025, 33, [1, 1, 1]),  # K one past a block, one hidden tile per expert
        (2100, 130, [4, 1, 3, 2, 4]),  # mixed rows: surplus row tiles skipped
        (6144 + 40, 97, [4, 4]),  # several K tiles at four rows (kt = 2048), odd D
        (3000, 640, [1, 2, 4, 3, 1, 1, 2, 4]),
    ],
)
def test_small_odd_widths(rng, fmt, gs, d, ie, rows):
    g = Group(rng, fmt, gs, d, ie, rows)
    g.set_x(rng.standard_normal((sum(rows), d)).astype(np.float32))
    check_both(g)


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_wide_range_activations(rng, fmt, gs):
    rows = [1, 4, 2]
    g = Group(rng, fmt, gs, 2048, 256, rows)
    # 10^+-8: wider, and silu(gate) * up overflows float32 on both paths (inf - inf = NaN)
    x = rng.standard_normal((7, 2048)) * 10.0 ** rng.uniform(-8, 8, (7, 1))
    g.set_x(x.astype(np.float32))
    check_both(g)


def check_replay(rng, g: Group, ln, want) -> None:
    """Counter reset (table copy) and launch ``ln`` captured once and replayed with new
    activations between replays: each replay the same bits as ``want()`` on those."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        g.set_x(rng.standard_normal((sum(g.rows), g.d)).astype(np.float32))
        g.run(ln)  # a direct launch first (module and parameter block ready before capture)
        stream.begin_capture()
        g.issue(ln)
        graph = stream.end_capture()
        for _ in range(3):
            g.set_x(rng.standard_normal((sum(g.rows), g.d)).astype(np.float32))
            expect = want()
            g.y.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(g.y.get().view(np.uint32), expect.view(np.uint32))


@pytest.mark.parametrize("fmt,gs,r", [(2, 0, 1), (4, 64, 1), (2, 0, 4)])
def test_graph_replay(rng, fmt, gs, r):
    # moe_tc_f replayed: the same bits as the direct launch of moe_tc.
    g = Group(rng, fmt, gs, 6144, 2048, [r] * 8)
    check_replay(rng, g, g.launch(True), lambda: g.run(g.launch(False)))


@pytest.fixture
def graphs(monkeypatch):
    from coliworker.kernels import graphs as cupy_graphs

    def switch(on: bool) -> None:
        monkeypatch.setattr(cupy_graphs, "ENABLED", on)

    return switch


@pytest.mark.parametrize("fmt,gs,r", [(2, 0, 1), (4, 128, 1), (2, 0, 4)])
def test_backend_fast_and_old_with_graphs(cupy_backend, rng, graphs, monkeypatch, fmt, gs, r):
    # Through CupyBackend.expert_group: graphs on (direct, captured, replayed) with the fast
    # path equals graphs off with the old path, bit for bit; both near float64. The old path
    # runs in a second backend: a backend keeps a group's launches in its arena's plans
    # (kernels/expert_group.py, keyed without MOE_TC_FAST), so the switch must be set before
    # its first call of a shape. moe_wq off: where "auto" takes it (fmt 4, one row) both
    # backends would run it.
    from coliworker.kernels import matmul
    from coliworker.server.backend_cupy import CupyBackend

    monkeypatch.setattr(matmul, "MOE_WQ", False)
    b = cupy_backend
    d, ie, n = 1024 + 64, 512, 8
    host = [
        tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
        for _ in range(n)
    ]
    dev = [tuple(b.place(t, 0) for t in e) for e in host]
    rows = [r] * n
    xs = [rng.standard_normal((r * n, d)).astype(np.float32) for _ in range(4)]
    graphs(True)
    got = [b.expert_group(dev, rows, x).out for x in xs]
    replayed = sum(sum(e is not None for e in a.graphs.execs.values()) for a in b._arenas(0))
    assert replayed > 0, "no call shape was captured"
    graphs(False)
    old_b = CupyBackend((0,))
    matmul.MOE_TC_FAST = False
    try:
        old_dev = [tuple(old_b.place(t, 0) for t in e) for e in host]
        want = [old_b.expert_group(old_dev, rows, x).out for x in xs]
    finally:
        matmul.MOE_TC_FAST = True
        old_b.close()
    for x, g_, w in zip(xs, got, want, strict=True):
        assert np.array_equal(g_.view(np.uint32), w.view(np.uint32))
        assert rel_err(g_, reference.expert_group(host, rows, x)) < TC_TOL


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128)])
def test_decode_runs_three_blocks_per_sm(rng, fmt, gs):
    # moe_tc_f<F, 1> is built for 3 blocks per SM (__launch_bounds__(256, 3): <= 80 registers,
    # no spills with nvcc 13; fmt 4's staged scales fit 3 blocks' shared memory at these
    # group sizes): its grid is 3 x the SMs where moe_tc's is 2 x.
    from coliworker.kernels import matmul

    g = Group(rng, fmt, gs, 6144, 2048, [1] * 8)
    n_sm = matmul._sm_count(0)
    new, old = g.launch(True), g.launch(False)
    assert new.fn.num_regs <= 80, new.fn.num_regs
    assert new.grid[0] == 3 * n_sm and old.grid[0] == 2 * n_sm, (new.grid, old.grid)
    print(f"moe_tc_f<{fmt}, 1>: {new.fn.num_regs} registers, {new.fn.local_size_bytes} B local")


def test_fmt4_small_groups_fall_back(rng):
    # gs = 16 at D = 6144: a gate+up tile's scales (2 x 32 x 385 floats) leave room for one
    # block per SM only, so MOE_TC_FAST keeps moe_tc there; the results are the same.
    g = Group(rng, 4, 16, 6144, 256, [1, 4, 1])
    g.set_x(rng.standard_normal((6, 6144)).astype(np.float32))
    check_both(g, fallback=True)
