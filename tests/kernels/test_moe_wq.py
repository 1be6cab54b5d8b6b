"""moe_wq (moe_wq.cu: the decode expert group of 1 to 4 rows per expert, fmt 2 and fmt 4
with group sizes 32 to 256, one warp per item with its own cp.async ring) against the float64
reference, driven through ``moe_launch`` with the job tables of test_moe_tc.py, in every form
of ``matmul.WQ_FORMS``.

moe_wq sums K in one accumulator per row where moe_tc sums four k slices, so its bits are its
own: each output within ``TC_TOL`` of float64, every output written, the same bits on every
call and from a replayed graph. Shapes: GLM-5.2's decode group (8 experts, D = 6144,
I = 2048) at 1, 4 and mixed rows, small widths (outputs not a multiple of the 16- and 32-row
items, K ending inside a stage), activations over 16 decades; widths it does not serve fall
back to moe_tc_f."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import TC_TOL, row_rel_err
from test_moe_tc import Group, _rebuild, check_replay

pytestmark = pytest.mark.gpu


def check_wq(g: Group, calls: int = 3) -> None:
    from coliworker.kernels import matmul

    ref = g.reference()
    for sd in matmul.WQ_FORMS:
        ln = g.launch(True, sd)
        assert ln.block == (32,), ln.block  # moe_wq, not moe_tc_f
        y = g.run(ln)
        assert not np.isnan(y).any(), f"moe_wq<{sd}> left outputs unwritten"
        assert row_rel_err(y, ref) < TC_TOL, (sd, row_rel_err(y, ref))
        for _ in range(calls):
            assert np.array_equal(g.run(ln).view(np.uint32), y.view(np.uint32)), sd


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128), (4, 32)])
def test_glm52_decode_group(rng, fmt, gs):
    # 8 experts at GLM-5.2 width: rows 1 (moe_wq<F, 1, ...>), 4 and mixed (<F, 4, ...>).
    g = Group(rng, fmt, gs, 6144, 2048, [1] * 8)
    for rows in ([1] * 8, [4] * 8, [1, 4, 2, 3, 1, 4, 2, 1]):
        g = _rebuild(g, rows)
        g.set_x(rng.standard_normal((sum(rows), 6144)).astype(np.float32))
        check_wq(g)


@pytest.mark.parametrize(
    "d,ie,rows",
    [
        (200, 72, [1] * 8),  # one 1024-element block of K, outputs not an item multiple
        (1028, 36, [1, 1, 1]),  # K 4 past a block: the last stage mostly zero-filled
        (2100, 132, [4, 1, 3, 2, 4]),  # mixed rows
        (3000, 640, [1, 2, 4, 3, 1, 1, 2, 4]),
    ],
)
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 256)])
def test_small_widths(rng, fmt, gs, d, ie, rows):
    g = Group(rng, fmt, gs, d, ie, rows)
    g.set_x(rng.standard_normal((sum(rows), d)).astype(np.float32))
    check_wq(g)


@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_wide_range_activations(rng, fmt, gs):
    g = Group(rng, fmt, gs, 2048, 256, [1, 4, 2])
    x = rng.standard_normal((7, 2048)) * 10.0 ** rng.uniform(-8, 8, (7, 1))
    g.set_x(x.astype(np.float32))
    check_wq(g)


@pytest.mark.parametrize(
    "fmt,gs,d,ie,rows",
    [
        (4, 16, 2048, 256, [1] * 4),
        (4, 48, 2048, 256, [1] * 4),
        (2, 0, 2048, 256, [5, 1]),
        (2, 0, 1025, 33, [1, 1]),
    ],
)
def test_not_served_falls_back(rng, fmt, gs, d, ie, rows):
    # Groups of 16 or not a power of two, more than four rows, or a width that is not a
    # multiple of 4: moe_tc_f's launch.
    g = Group(rng, fmt, gs, d, ie, rows)
    assert g.launch(True, (2, 4)).block != (32,)


def test_graph_replay(rng):
    # moe_wq replayed: the same bits as its direct launch.
    g = Group(rng, 2, 0, 6144, 2048, [1] * 8)
    ln = g.launch(True, (2, 4))
    check_replay(rng, g, ln, lambda: g.run(ln))
