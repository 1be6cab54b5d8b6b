"""The matmul op (kernels/matmul.py; gemv.cu, gemv_tc.cu, prefill_tc.cu) through CupyBackend
against the float64 reference. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import FMT_GS, REL_TOL, TC_TOL, make_tensor, rel_err

from coliworker.kernels import reference


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", FMT_GS)
@pytest.mark.parametrize(
    "s,o,i", [(1, 1, 1), (1, 67, 7), (3, 33, 130), (9, 70, 1025), (5, 9, 2100)]
)
def test_gemv_matches_reference(cupy_backend, rng, fmt, gs, s, o, i):
    t = make_tensor(rng, fmt, o, i, gs)
    x = rng.standard_normal((s, i)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert res.out.shape == (s, o)
    assert rel_err(res.out, reference.matmul(t, x)) < REL_TOL


@pytest.mark.gpu
def test_gemv_long_rows_use_several_k_tiles(cupy_backend, rng):
    # 8 rows x 20000 inputs: the staged x does not fit one tile.
    t = make_tensor(rng, 4, 40, 20000, 64)
    x = rng.standard_normal((8, 20000)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert rel_err(res.out, reference.matmul(t, x)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 128), (4, 48)])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_tensor_core_gemv_exact_over_wide_range(cupy_backend, rng, fmt, gs, s):
    # Activations spanning 1e-30 .. 1e30 (no per-row scaling needed), a GLM-5.2 width, rows
    # that are not a multiple of the 32-row tile, and in_features not a multiple of 1024.
    t = make_tensor(rng, fmt, 6144 + 40, 6144, gs)
    x = rng.standard_normal((s, 6144)) * 10.0 ** rng.uniform(-30, 30, (s, 1))
    x = x.astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    ref = reference.matmul(t, x)
    for k in range(s):
        assert rel_err(res.out[k], ref[k]) < TC_TOL
    t2 = make_tensor(rng, fmt, 33, 2100, gs)
    x2 = rng.standard_normal((s, 2100)).astype(np.float32)
    assert rel_err(cupy_backend.matmul(cupy_backend.place(t2, 0), x2).out,
                   reference.matmul(t2, x2)) < TC_TOL  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_fp32_gemv_path_still_exact(cupy_backend, rng, no_tensor_cores, fmt, gs):
    t = make_tensor(rng, fmt, 70, 1025, gs)
    x = rng.standard_normal((3, 1025)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert rel_err(res.out, reference.matmul(t, x)) < REL_TOL
