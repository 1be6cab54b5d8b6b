"""``kernels/copy.py``: a call's small host <-> device copies as a kernel, byte for byte, and a
backend call the same with copy kernels on and off. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import make_tensor

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4096, 24577, 196608, 1 << 20])
def test_copy_kernel_moves_every_byte_both_ways(rng, n):
    import cupy
    import cupyx

    from coliworker.kernels.copy import copy_launch

    host = cupyx.empty_pinned((n + 32,), np.uint8)
    host[:] = rng.integers(0, 256, n + 32, dtype=np.uint8)
    want = host.copy()
    dev = cupy.zeros(n + 32, cupy.uint8)
    go = copy_launch(n)
    assert go is not None
    go(np.uint64(dev.data.ptr), np.uint64(host.ctypes.data))
    cupy.cuda.get_current_stream().synchronize()
    got = cupy.asnumpy(dev)
    assert np.array_equal(got[:n], want[:n]) and not got[n:].any()  # nothing past n
    dev[:n] = cupy.asarray(rng.integers(0, 256, n, dtype=np.uint8))
    host[:] = 0
    go(np.uint64(host.ctypes.data), np.uint64(dev.data.ptr))
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(host[:n], cupy.asnumpy(dev[:n])) and not host[n:].any()


def test_copy_kernels_beyond_the_limit_stay_on_the_copy_engine():
    from coliworker.kernels import copy

    assert copy.copy_launch(copy.KERNEL_BYTES + 1) is None


def test_calls_are_the_same_with_copy_kernels_on_and_off(cupy_backend, rng, monkeypatch):
    from coliworker.kernels import copy

    b = cupy_backend
    w = b.place(make_tensor(rng, 2, 300, 512), 0)
    experts = [
        tuple(b.place(make_tensor(rng, 2, *s), 0) for s in ((128, 512), (128, 512), (512, 128)))
        for _ in range(4)
    ]
    for _ in range(3):
        x = rng.standard_normal((3, 512)).astype(np.float32)
        xs = rng.standard_normal((8, 512)).astype(np.float32)
        outs = []
        for on in (False, True):
            monkeypatch.setattr(copy, "ENABLED", on)
            outs.append((b.matmul(w, x).out, b.expert_group(experts, [2] * 4, xs).out))
        for a, c in zip(*outs, strict=True):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))
