"""The tensor-core decode kernels with their weights streamed through the cp.async ring
(``matmul.TC_PIPELINE``): the same bits as the register-loaded path, and the float64
reference within the tensor-core tolerance, on shapes that exercise the ring's edges (fewer
steps per warp than slots, K tiles, rows past the tile, ragged row counts)."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_kernels import _experts, make_tensor, rel_err

from coliworker.kernels import reference

TC_TOL = 1e-5


@pytest.fixture
def cupy_backend():
    from coliworker.server.backend_cupy import CupyBackend

    b = CupyBackend((0,))
    yield b
    b.close()


def _both(fn):
    """fn() with the ring off, then on (the module switch restored)."""
    from coliworker.kernels import matmul

    saved = matmul.TC_PIPELINE
    try:
        matmul.TC_PIPELINE = False
        plain = fn()
        matmul.TC_PIPELINE = True
        ring = fn()
    finally:
        matmul.TC_PIPELINE = saved
    return plain, ring


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 2, 4])
@pytest.mark.parametrize("o,i", [(1, 128), (33, 640), (70, 2100), (6144 + 40, 6144), (96, 20000)])
def test_ring_gemv_same_bits(cupy_backend, rng, s, o, i):
    t = make_tensor(rng, 2, o, i)
    w = cupy_backend.place(t, 0)
    x = (rng.standard_normal((s, i)) * 10.0 ** rng.uniform(-20, 20, (s, 1))).astype(np.float32)
    plain, ring = _both(lambda: cupy_backend.matmul(w, x).out)
    assert np.array_equal(plain, ring)
    want = reference.matmul(t, x)
    for k in range(s):
        assert rel_err(ring[k], want[k]) < TC_TOL


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,d,ie", [([1] * 8, 6144, 2048), ([4] * 8, 2048 + 64, 640), ([2, 1, 4, 3], 1000, 96)]
)
def test_ring_expert_group_same_bits(cupy_backend, rng, rows, d, ie):
    host, dev = _experts(cupy_backend, rng, len(rows), d, ie, 2, 0)
    x = rng.standard_normal((sum(rows), d)).astype(np.float32)
    plain, ring = _both(lambda: cupy_backend.expert_group(dev, rows, x).out)
    assert np.array_equal(plain, ring)
    assert rel_err(ring, reference.expert_group(host, rows, x)) < TC_TOL


@pytest.mark.gpu
def test_ring_leaves_grouped_scales_on_registers(cupy_backend, rng):
    """fmt 4 has no ring variant: the switch changes nothing there."""
    host, dev = _experts(cupy_backend, rng, 3, 512, 64, 4, 64)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    plain, ring = _both(lambda: cupy_backend.expert_group(dev, [1, 1, 1], x).out)
    assert np.array_equal(plain, ring)
    assert rel_err(ring, reference.expert_group(host, [1, 1, 1], x)) < TC_TOL
