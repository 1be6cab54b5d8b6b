"""Split-K of the tensor-core decode GEMV (gemv_tc_k / gemv_tc_sk, gemv_tc_splitk.cuh) and the
streamed one (gemv_st, gemv_stream.cuh) against gemv_tc and the float64 reference, driven
through ``gemv_launch`` with job tables built here.

Every case runs the same jobs with ``matmul.SPLIT_K`` off (gemv_tc), on (the host's choice of
cluster size), forced to each cluster size C in ``SK_CLUSTERS``, and with ``gemv_stream.STREAM`` on
(gemv_st where it serves the jobs): results within ``TC_TOL``
of float64 per activation row, and the same bits on every call of one launch (also replayed
from a CUDA graph). Shapes cross the edges of the split: output rows not a multiple of the
32-row tile, in_features ending inside a rank's share of K, shares that start inside a
512-byte block (fmt 4 group index from a step that is not block aligned), several staged
tiles per rank, and ragged job tables (jobs with fewer rows or outputs than the launch's
maximum: whole clusters leave early).
"""

from __future__ import annotations

import numpy as np
import pytest
from _kern import TC_TOL, make_tensor, row_rel_err

from coliworker.kernels import reference
from coliworker.kernels.qtensor import QTensor


def job_dtype() -> np.dtype:
    """The dtype of ``struct GemvJob`` (kernels/records.py)."""
    from coliworker.kernels.records import GEMV_JOB

    return GEMV_JOB.dtype


class Jobs:
    """One weight tensor on the device, sliced into jobs of ``out_rows[j]`` consecutive rows
    each (like the value projection's heads of kv_b), activations ``xs[j]`` [rows_j, I]."""

    def __init__(self, t: QTensor, out_rows: list[int], xs: list[np.ndarray]):
        import cupy

        from coliworker.kernels import layout, matmul

        assert sum(out_rows) <= t.out_features and len(out_rows) == len(xs)
        self.t, self.out_rows, self.xs = t, out_rows, xs
        self.spec = matmul.WeightSpec.of(t.fmt, t.in_features, t.group_size)
        lay = self.spec.layout
        self.w = layout.relayout(cupy, t, cupy.asarray(t.weights))
        self.s = layout.scales(cupy, t, cupy.asarray(t.scales))
        ngp = max(lay.ngp, 1)
        self.x = [cupy.asarray(np.ascontiguousarray(x, np.float32)) for x in xs]
        pairs = zip(xs, out_rows, strict=True)
        self.y = [cupy.zeros((x.shape[0], o), cupy.float32) for x, o in pairs]
        host = np.zeros(len(xs), job_dtype())
        r0 = 0
        for j, (o, x, xd, yd) in enumerate(zip(out_rows, xs, self.x, self.y, strict=True)):
            host[j]["w0"] = self.w.data.ptr + r0 * lay.ld
            host[j]["s0"] = self.s.data.ptr + 4 * r0 * (ngp if t.fmt == 4 else 1)
            host[j]["x"], host[j]["y"] = xd.data.ptr, yd.data.ptr
            host[j]["rows"], host[j]["out_rows"] = x.shape[0], o
            host[j]["x_stride"], host[j]["y_stride"] = t.in_features, o
            r0 += o
        self.table = cupy.asarray(host.view(np.uint8))
        self.max_rows = max(x.shape[0] for x in xs)

    def reference(self) -> list[np.ndarray]:
        w = reference.dequantize(self.t)
        out, r0 = [], 0
        for o, x in zip(self.out_rows, self.xs, strict=True):
            out.append(np.asarray(x, np.float64) @ w[r0 : r0 + o].T)
            r0 += o
        return out

    def launch(self, split: bool, force: int | None = None, stream: bool | str = False):
        """stream: True for gemv_st, "q8" for its integer path (ST_Q8)."""
        from coliworker.kernels import gemv_stream, matmul

        saved = matmul.SPLIT_K, matmul.SPLIT_K_FORCE, gemv_stream.STREAM, gemv_stream.ST_Q8
        matmul.SPLIT_K, matmul.SPLIT_K_FORCE = split, force
        gemv_stream.STREAM, gemv_stream.ST_Q8 = bool(stream), stream == "q8"
        try:
            ln = matmul.gemv_launch(self.spec, len(self.xs), self.max_rows, max(self.out_rows))
        finally:
            matmul.SPLIT_K, matmul.SPLIT_K_FORCE, gemv_stream.STREAM, gemv_stream.ST_Q8 = saved
        assert ln is not None
        return ln

    def run(self, ln) -> list[np.ndarray]:
        import cupy

        for y in self.y:
            y.fill(np.nan)  # every output must be written
        ln(np.uint64(self.table.data.ptr))
        cupy.cuda.get_current_stream().synchronize()
        return [y.get() for y in self.y]


def paths() -> list[tuple[str, bool, int | None, bool | str]]:
    """(name, SPLIT_K, SPLIT_K_FORCE, STREAM) of every path; "stream" is gemv_st where it
    serves the jobs (fmt 2, up to 4 rows, x fitting beside the ring), else the split path;
    "q8" its integer path (fmt 2; fmt 4 as "stream")."""
    from coliworker.kernels import matmul

    return (
        [("off", False, None, False), ("on", True, None, False)]
        + [(f"C={c}", True, c, False) for c in matmul.SK_CLUSTERS]
        + [("stream", True, None, True), ("q8", True, None, "q8")]
    )


def check_all_paths(jobs: Jobs, tol: float = TC_TOL) -> dict[str, list[np.ndarray]]:
    """Every path within tol of float64 (per job, per activation row), two calls the same bits."""
    from coliworker.kernels import gemv_stream

    ref = jobs.reference()
    got = {}
    saved_stream, saved_q8 = gemv_stream.STREAM, gemv_stream.ST_Q8
    for name, split, force, stream in paths():
        ln = jobs.launch(split, force, stream)
        if stream:  # gemv_st (its math warps and a producer) exactly where it serves the jobs
            gemv_stream.STREAM, gemv_stream.ST_Q8 = True, stream == "q8"
            try:
                served = gemv_stream.stream_eligible(jobs.spec, jobs.max_rows)
                geo = gemv_stream._st_geometry(jobs.spec, jobs.max_rows, False)
            finally:
                gemv_stream.STREAM, gemv_stream.ST_Q8 = saved_stream, saved_q8
            st_block = (geo[4] + 1) * 32 if served else None
            assert (ln.block[0] == st_block) == served, (name, ln.block)
        ys = jobs.run(ln)
        for j, (y, r) in enumerate(zip(ys, ref, strict=True)):
            assert not np.isnan(y).any(), (name, j)
            assert row_rel_err(y, r) < tol, (name, j, row_rel_err(y, r))
        again = jobs.run(ln)
        assert all(np.array_equal(a, b) for a, b in zip(ys, again, strict=True)), name
        got[name] = ys
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128)])
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 8])
def test_split_k_dense_glm_width(rng, fmt, gs, s):
    # The bench's dense shape, 6144 x 6144: 48 steps of K, split 2, 4 and 8 ways; 5 and 8 rows
    # are SB = 8 tiles (with split-K off they are gemv_pf's).
    t = make_tensor(rng, fmt, 6144, 6144, gs)
    x = rng.standard_normal((s, 6144)).astype(np.float32)
    got = check_all_paths(Jobs(t, [6144], [x]))
    # Split-K changes only the summation order: it agrees with gemv_tc to float rounding.
    for name in got:
        assert row_rel_err(got[name][0], got["off"][0]) < 2 * TC_TOL, name


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 48), (4, 16)])
@pytest.mark.parametrize(
    "s,o,i",
    [
        (1, 1, 7),  # one output, one step of K per rank at C = 8
        (1, 33, 130),  # one 1024-element block: ranks of 1, 2, 4 steps
        (3, 67, 1025),  # two blocks, in_features one past the first
        (4, 6144 + 40, 2100),  # 24 steps: shares of 3 start inside a block; K ends in rank 5
        (1, 300, 20000),  # 160 steps: several staged tiles per rank at C = 1 and 2
        (2, 97, 9000),  # SB = 4 tiles of 16 steps: 72 steps over 1, 2, 4, 8 ranks
        (7, 97, 9000),  # SB = 8 tiles of 8 steps, one row short of the tile
        (6, 6144 + 40, 4100),  # SB = 8 with K ending inside a rank
    ],
)
def test_split_k_odd_sizes(rng, fmt, gs, s, o, i):
    t = make_tensor(rng, fmt, o, i, gs)
    x = rng.standard_normal((s, i)).astype(np.float32)
    check_all_paths(Jobs(t, [o], [x]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
@pytest.mark.parametrize("s", [1, 4])
def test_split_k_wide_range_activations(rng, fmt, gs, s):
    # Rows spanning 1e-30 .. 1e30: no per-row scaling, as gemv_tc (the split sums fp32 partials).
    t = make_tensor(rng, fmt, 1000, 6144, gs)
    x = rng.standard_normal((s, 6144)) * 10.0 ** rng.uniform(-30, 30, (s, 1))
    check_all_paths(Jobs(t, [1000], [x.astype(np.float32)]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
@pytest.mark.parametrize("s", [1, 4, 8])
def test_split_k_value_projection(rng, fmt, gs, s):
    # (8 rows: K = 512 is below SB8_MIN_K, so gemv_pf on both paths.)
    # GLM-5.2's value projection: 64 heads, each [256 x 512] of kv_b, one job per head.
    t = make_tensor(rng, fmt, 64 * 256, 512, gs)
    xs = [rng.standard_normal((s, 512)).astype(np.float32) for _ in range(64)]
    check_all_paths(Jobs(t, [256] * 64, xs))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 32)])
def test_split_k_ragged_jobs(rng, fmt, gs):
    # Jobs below the launch's maximum rows and outputs: their surplus tiles (whole clusters)
    # leave before any barrier; the rest must still meet.
    outs = [256, 31, 200, 5, 129, 64]  # each >= 5 outputs: a max over one can be ~0
    for rows in ([4, 1, 3, 2, 4, 1], [8, 1, 6, 2, 5, 3]):  # SB = 4, then SB = 8 tiles
        t = make_tensor(rng, fmt, sum(outs), 4500, gs)
        xs = [rng.standard_normal((r, 4500)).astype(np.float32) for r in rows]
        check_all_paths(Jobs(t, outs, xs))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_split_k_bit_identical_and_graph_replay(rng, fmt, gs):
    import cupy

    t = make_tensor(rng, fmt, 6144, 16384, gs)  # o_proj's shape
    x = rng.standard_normal((1, 16384)).astype(np.float32)
    jobs = Jobs(t, [6144], [x])
    for force, stream in ((None, False), (2, False), (4, False), (8, False), (None, True)):
        ln = jobs.launch(True, force, stream)
        first = jobs.run(ln)[0]
        for _ in range(10):
            assert np.array_equal(jobs.run(ln)[0], first), force
        # The same launch captured once and replayed: same parameters, same bits.
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            jobs.y[0].fill(np.nan)
            stream.begin_capture()
            ln(np.uint64(jobs.table.data.ptr))
            graph = stream.end_capture()
            for _ in range(3):
                jobs.y[0].fill(np.nan)
                graph.launch(stream)
                stream.synchronize()
                assert np.array_equal(jobs.y[0].get(), first), force


@pytest.mark.gpu
def test_split_k_through_backend_matmul(cupy_backend, rng):
    # CupyBackend.matmul takes the split path by default, gemv_st with STREAM on, gemv_tc with
    # both off.
    from coliworker.kernels import gemv_stream, matmul

    b = cupy_backend
    t = make_tensor(rng, 2, 6144, 6144)
    w = b.place(t, 0)
    x = rng.standard_normal((1, 6144)).astype(np.float32)
    ref = reference.matmul(t, x)
    got = {}
    saved = matmul.SPLIT_K, gemv_stream.STREAM
    try:
        for split, stream in ((True, True), (True, False), (False, False)):
            matmul.SPLIT_K, gemv_stream.STREAM = split, stream
            got[split, stream] = b.matmul(w, x).out
    finally:
        matmul.SPLIT_K, gemv_stream.STREAM = saved
    for k, y in got.items():
        assert row_rel_err(y, ref) < TC_TOL, k
    # the defaults: split-K, and at one row no gemv_st unless STREAM is True
    assert np.array_equal(got[saved[0], saved[1] is True], b.matmul(w, x).out)


def test_split_k_host_choice_fills_the_gpu():
    # The cluster-size model with a given occupancy (no kernel is compiled or run; matmul
    # imports CuPy): grids that leave block slots empty are split, grids of several waves are
    # not; the shared memory of every geometry fits the 3 blocks per SM that fmt 2 counts on.
    pytest.importorskip("cupy")
    from coliworker.kernels import matmul

    def choose(fmt, n_jobs, max_rows, max_out, in_features, occ, n_sm=132):
        spec = matmul.WeightSpec.of(fmt, in_features, 64 if fmt == 4 else 0)
        return matmul._sk_choice(spec, n_jobs, max_rows, max_out, n_sm, lambda c, smem: occ)

    assert choose(2, 1, 1, 6144, 6144, 3) == 2  # 192 tiles on 396 slots
    assert choose(2, 1, 1, 6144, 16384, 3) == 2  # o_proj
    assert choose(2, 1, 4, 6144, 6144, 3) == 2
    assert choose(2, 64, 1, 256, 512, 3) == 1  # value projection: 512 blocks already
    assert choose(2, 1, 1, 256, 6144, 3) == 8  # 8 tiles: split as far as it goes
    for sb_rows in (1, 4):
        for c in matmul.SK_CLUSTERS:
            for k in (512, 6144, 16384, 20000):
                _, kts, smem = matmul._sk_geometry(sb_rows, matmul.Layout.of(2, k, 0).in_padded, c)
                assert kts >= 1 and 3 * (smem + 1024) <= 227 * 1024


@pytest.mark.gpu
def test_q8_non_finite_rows(rng):
    # gemv_st's integer path: a row holding a NaN or an infinity comes back NaN throughout (no
    # power-of-two scale fits it); the other rows of the same tile are as without it.
    t = make_tensor(rng, 2, 300, 6144, 0)
    x = rng.standard_normal((4, 6144)).astype(np.float32)
    x[1, 77], x[2, 5000] = np.nan, np.inf
    jobs = Jobs(t, [300], [x])
    y = jobs.run(jobs.launch(True, None, "q8"))[0]
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    ref = jobs.reference()[0]
    assert row_rel_err(y[[0, 3]], ref[[0, 3]]) < TC_TOL
