"""The CuPy backend as a whole: calls from several threads at once (pipelined prefill groups
too: their copy threads are shared), out-of-memory as a typed, recoverable error. GPU only."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from _kern import REL_TOL, make_tensor, rel_err

from coliworker.kernels import reference


def in_threads(work, n: int) -> None:
    """``work(0) .. work(n - 1)``, each on its own thread, all at once; back when all are done."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


@pytest.mark.gpu
def test_concurrent_threads(cupy_backend, rng):
    b = cupy_backend
    t = make_tensor(rng, 2, 300, 513)
    w = b.place(t, 0)
    xs = [rng.standard_normal((2, 513)).astype(np.float32) for _ in range(8)]
    refs = [reference.matmul(t, x) for x in xs]
    errors: list[str] = []

    def work(n: int) -> None:
        for _ in range(20):
            out = b.matmul(w, xs[n]).out
            if rel_err(out, refs[n]) >= REL_TOL:
                errors.append(f"thread {n}")

    in_threads(work, 8)
    assert not errors


@pytest.mark.gpu
def test_concurrent_threads_pipelined_groups(cupy_backend, rng, monkeypatch):
    from coliworker.kernels import expert_group as eg

    b = cupy_backend
    rows = [300, 17, 250, 5, 128, 330]  # 1030 x 4096 float32: over 16 MiB, pipelined
    experts = [
        tuple(
            b.place(make_tensor(rng, 2, *sh), 0) for sh in ((256, 4096), (256, 4096), (4096, 256))
        )
        for _ in rows
    ]
    xs = [rng.standard_normal((sum(rows), 4096)).astype(np.float32) for _ in range(4)]
    assert 4 * xs[0].size >= eg.PIPE_BYTES
    monkeypatch.setattr(eg, "PIPELINE", True)  # whatever COLIWORKER_PREFILL_PIPELINE says
    limit = eg.PIPE_BYTES
    monkeypatch.setattr(eg, "PIPE_BYTES", 1 << 62)
    want = [b.expert_group(experts, rows, x).out for x in xs]  # one launch, this thread
    monkeypatch.setattr(eg, "PIPE_BYTES", limit)
    errors: list[str] = []

    def work(n: int) -> None:
        for k in range(3):
            out = b.expert_group(experts, rows, xs[(n + k) % 4]).out
            if not np.array_equal(out.view(np.uint32), want[(n + k) % 4].view(np.uint32)):
                errors.append(f"thread {n} call {k}")

    in_threads(work, 4)
    assert not errors


@pytest.mark.gpu
def test_out_of_memory_is_typed_and_recoverable(cupy_backend, rng):
    import cupy

    from coliworker.server.errors import OutOfDeviceMemory

    b = cupy_backend
    t = make_tensor(rng, 1, 64, 64)
    w = b.place(t, 0)
    kv = b.new_kv(0, 16, 4)
    kv.append(np.ones((10, 16), np.float32), np.ones((10, 4), np.float32))
    big = make_tensor(rng, 1, 8192, 8192)  # 64 MiB
    gc.collect()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=pool.used_bytes() + (4 << 20))
    try:
        with pytest.raises(OutOfDeviceMemory, match="device 0"):
            b.place(big, 0)
        with pytest.raises(OutOfDeviceMemory):
            kv.append(np.ones((100000, 16), np.float32), np.ones((100000, 4), np.float32))
        assert kv.length == 10 and kv.cap == 256
    finally:
        pool.set_limit(size=0)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    assert rel_err(b.matmul(w, x).out, reference.matmul(t, x)) < REL_TOL


@pytest.mark.gpu
def test_pinned_host_memory_past_the_cgroup_is_refused_and_the_backend_keeps_working(
    cupy_backend, rng, monkeypatch
):
    from coliworker.server import hostmem
    from coliworker.server.errors import OutOfDeviceMemory

    b = cupy_backend
    w = b.place(make_tensor(rng, 2, 64, 4096), 0)
    small = rng.standard_normal((1, 4096)).astype(np.float32)
    want = b.matmul(w, small).out
    # A container whose memory cgroup has 100 MiB left: a 256 MiB input needs a pinned
    # buffer past it.
    monkeypatch.setattr(hostmem, "host_memory", lambda: (1 << 40, 100 << 20))
    big = rng.standard_normal((16384, 4096)).astype(np.float32)
    with pytest.raises(OutOfDeviceMemory, match="pinned host memory: needs"):
        b.matmul(w, big)
    with pytest.raises(OutOfDeviceMemory, match="upload staging"):
        b.staging(512 << 20)
    assert np.array_equal(b.matmul(w, small).out, want)
