"""``kernels/copy.py``: a call's small host <-> device copies as a kernel, byte for byte, and a
backend call the same with copy kernels on and off. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import make_tensor

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4096, 6000, 24577, 40000, 196608, 1 << 20])
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
    none = (np.uint64(0), np.uint64(0))  # no phase stamps
    go(np.uint64(dev.data.ptr), np.uint64(host.ctypes.data), *none)
    cupy.cuda.get_current_stream().synchronize()
    got = cupy.asnumpy(dev)
    assert np.array_equal(got[:n], want[:n]) and not got[n:].any()  # nothing past n
    dev[:n] = cupy.asarray(rng.integers(0, 256, n, dtype=np.uint8))
    host[:] = 0
    go(np.uint64(host.ctypes.data), np.uint64(dev.data.ptr), *none)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(host[:n], cupy.asnumpy(dev[:n])) and not host[n:].any()


@pytest.mark.parametrize("n", [16, 4096, 196608, 1 << 20])
def test_copy_kernel_stamps(rng, n):
    # The phase stamps: each launch leaves (first block's start, last block's end) of the
    # GPU's global timer in host memory, inside the span of events around it, and resets its
    # CopyStamp record, so launch after launch (one graph replayed, or direct) reads anew.
    import cupy
    import cupyx

    from coliworker.kernels.copy import copy_launch

    host = cupyx.empty_pinned((n,), np.uint8)
    dev = cupy.zeros(n, cupy.uint8)
    rec = cupy.asarray(np.array([np.iinfo(np.uint64).max, 0, 0], np.uint64))
    out = cupyx.empty_pinned((2,), np.uint64)
    go = copy_launch(n)
    stamp = (np.uint64(rec.data.ptr), np.uint64(out.ctypes.data))
    timer = cupy.RawKernel(
        r"""extern "C" __global__ void now(unsigned long long *t) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(*t)); }""",
        "now",
    )
    t = cupy.zeros(2, cupy.uint64)
    last = 0
    for _ in range(3):
        host[:] = rng.integers(0, 256, n, dtype=np.uint8)
        out[:] = 0
        timer((1,), (1,), (t,))
        go(np.uint64(dev.data.ptr), np.uint64(host.ctypes.data), *stamp)
        timer((1,), (1,), (t[1:],))
        cupy.cuda.get_current_stream().synchronize()
        before, after = (int(v) for v in t.get())
        first, end = (int(v) for v in out)
        assert before <= first <= end <= after, (before, first, end, after)
        assert first > last  # a fresh stamp, not the last launch's
        last = end
        assert np.array_equal(rec.get(), [np.iinfo(np.uint64).max, 0, 0])  # reset
        assert np.array_equal(cupy.asnumpy(dev), host)


def test_copy_kernels_beyond_the_limit_stay_on_the_copy_engine():
    from coliworker.kernels import copy

    assert copy.copy_launch(copy.KERNEL_BYTES + 1) is None


def _weights(b, rng):
    """A resident 300 x 512 matrix and 4 experts (512 -> 128 -> 512), int4, on device 0."""
    w = b.place(make_tensor(rng, 2, 300, 512), 0)
    experts = [
        tuple(b.place(make_tensor(rng, 2, *s), 0) for s in ((128, 512), (128, 512), (512, 128)))
        for _ in range(4)
    ]
    return w, experts


def test_calls_are_the_same_with_copy_kernels_on_and_off(cupy_backend, rng, monkeypatch):
    from coliworker.kernels import copy

    b = cupy_backend
    w, experts = _weights(b, rng)
    for _ in range(3):
        x = rng.standard_normal((3, 512)).astype(np.float32)
        xs = rng.standard_normal((8, 512)).astype(np.float32)
        outs = []
        for on in (False, True):
            monkeypatch.setattr(copy, "ENABLED", on)
            outs.append((b.matmul(w, x).out, b.expert_group(experts, [2] * 4, xs).out))
        for a, c in zip(*outs, strict=True):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


def test_call_phases_from_copy_stamps_and_from_events(cupy_backend, rng, monkeypatch):
    # A decode call's phases come from its copy kernels' stamps (one event after all its
    # work), a call whose copies are on the copy engine from four events: either way every
    # phase is positive and they sum to no more than the call's wall time, on direct,
    # captured and replayed calls alike.
    import time
    from functools import partial

    from coliworker.kernels import copy

    b = cupy_backend
    w, experts = _weights(b, rng)
    for on in (True, False):
        monkeypatch.setattr(copy, "ENABLED", on)
        for _ in range(4):  # direct, captured, replayed, replayed
            x = rng.standard_normal((3, 512)).astype(np.float32)
            xs = rng.standard_normal((8, 512)).astype(np.float32)
            for call in (partial(b.matmul, w, x), partial(b.expert_group, experts, [2] * 4, xs)):
                t0 = time.perf_counter_ns()
                p = call().phases
                wall = time.perf_counter_ns() - t0
                assert p.h2d_ns > 0 and p.kernel_ns > 0 and p.d2h_ns > 0, (on, p)
                assert p.total_ns <= wall, (on, p, wall)
