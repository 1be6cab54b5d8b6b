"""Large arrays through shared memory: the threaded copies in and out of a segment, and (CuPy
backend) inputs read by the device straight from the registered segment.

Every result is checked against the float64 NumPy reference and, to the bit, against the
same call through gRPC chunks (no shared memory): the bytes must arrive unchanged whatever
path they take, at odd sizes and unaligned offsets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _hotpath import f32_tensor, int4_tensor, mapped, upload, wait_for

from coliworker.client import WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.wire import shm as shm_mod
from coliworker.wire.shm import HEADER_BYTES, PARALLEL_BYTES, Segment, ShmError

TOL = 1e-4  # CuPy kernels vs the float64 reference (fp32 activations); NumPy is far closer
# matmul [S, IN] x [OUT, IN]^T: x is 9.3 MB (past the backend's 8 MiB direct/threaded inputs), y
# 4.7 MB (past PARALLEL_BYTES); odd widths, so no row is a multiple of a tile or a page
S, IN, OUT = 9001, 257, 131
D, IE, T = 48, 24, 45_001  # expert group: x and y [T, D] float32, 8.6 MB each


def rel_err(y: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(y - want).max() / max(np.abs(want).max(), 1e-30))


# -- the segment's copies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "n",
    [1, 4097, PARALLEL_BYTES - 1, PARALLEL_BYTES, PARALLEL_BYTES + 12_345, 3 * PARALLEL_BYTES + 7],
)
@pytest.mark.parametrize("skew", [0, 3, 61])
def test_write_and_read_array_exact_with_neighbours_untouched(n, skew, rng):
    seg = Segment.create(n + 4096)
    try:
        before = rng.integers(0, 256, seg.size, dtype=np.uint8)
        seg.buf[:] = before
        off = HEADER_BYTES + 64 + skew
        data = rng.integers(0, 256, n, dtype=np.uint8)
        seg.write(off, memoryview(data).toreadonly())
        np.testing.assert_array_equal(seg.buf[off : off + n], data)
        np.testing.assert_array_equal(seg.buf[:off], before[:off])
        np.testing.assert_array_equal(seg.buf[off + n :], before[off + n :])
        got = seg.read_array(off, n, "x")
        assert got.flags.writeable and got.dtype == np.uint8 and got.shape == (n,)
        np.testing.assert_array_equal(got, data)
        # bytes (the doorbell's messages) and a float32 array's bytes take the same path
        more = rng.standard_normal(n // 4 + 1).astype(np.float32)
        raw = memoryview(more).cast("B")[: n - n % 4]
        seg.write(off, bytes(raw))
        np.testing.assert_array_equal(
            seg.read_array(off, len(raw), "x"), np.frombuffer(raw, np.uint8)
        )
        seg.write(off, raw)
        assert seg.read(off, len(raw), "x") == bytes(raw)
    finally:
        seg.close()


def test_copy_between_arrays_on_threads(rng):
    n = 5 * PARALLEL_BYTES + 4093
    src = rng.integers(0, 256, n + 7, dtype=np.uint8)
    dst = np.zeros(n + 11, np.uint8)
    shm_mod.copy(dst.ctypes.data + 5, src.ctypes.data + 7, n)
    np.testing.assert_array_equal(dst[5 : 5 + n], src[7:])
    assert not dst[:5].any() and not dst[5 + n :].any()


def test_out_of_range_and_closed_are_refused(rng):
    seg = Segment.create(PARALLEL_BYTES + 4096)
    with pytest.raises(ShmError, match="expected a slice inside"):
        seg.read_array(HEADER_BYTES, seg.size, "result")
    with pytest.raises(ShmError, match="expected a slice inside"):
        seg.read_array(HEADER_BYTES + 8, -4, "result")
    with pytest.raises(ShmError, match="expected a slice inside"):
        seg.write(seg.size - 8, bytes(16))
    seg.close()
    with pytest.raises(ShmError, match="detached"):
        seg.read_array(HEADER_BYTES, 8, "result")
    with pytest.raises(ShmError, match="detached"):
        seg.write(HEADER_BYTES, rng.integers(0, 256, PARALLEL_BYTES, dtype=np.uint8).data)


def test_close_hooks_run_once_before_the_unmap():
    seg = Segment.create(1 << 16)
    seen: list[tuple[str, bool]] = []
    seg.on_close(lambda: seen.append(("a", mapped(seg.name))))
    seg.on_close(lambda: 1 / 0)  # a failing hook is logged; the others run, the unmap happens
    seg.on_close(lambda: seen.append(("b", mapped(seg.name))))
    name = seg.name
    seg.close()
    seg.close()
    assert seen == [("a", True), ("b", True)] and not mapped(name)
    seg.on_close(lambda: seen.append(("late", False)))  # closed already: runs at once
    assert seen[-1] == ("late", False)


# -- through a worker, both backends ------------------------------------------------------

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request):
    srv = build_server(Config(backend=request.param, port=0, metrics_port=None)).start()
    rng = np.random.default_rng()
    with WorkerClient(srv.address, timeout=120, progress=False) as w:
        mat_t = f32_tensor(rng, IN, OUT)
        tensors = [
            (int4_tensor(rng, D, IE), int4_tensor(rng, D, IE), int4_tensor(rng, IE, D))
            for _ in range(3)
        ]
        refs = (upload(w, mat_t), [tuple(upload(w, t) for t in e) for e in tensors])
        yield srv, w, mat_t, tensors, refs
    srv.stop(0)


def _segments(srv):
    """The CuPy backend's record of the segments it maps (empty list for NumPy)."""
    return list(getattr(srv.servicer.backend, "_segments", []))


@pytest.mark.parametrize("doorbell", [False, True], ids=["stream", "doorbell"])
def test_large_calls_exact_both_directions(worker, doorbell, rng):
    srv, w, mat_t, tensors, (mat, experts) = worker
    x = rng.standard_normal((S, IN)).astype(np.float32)
    rows = [T // 3, T // 3 + 5, T - 2 * (T // 3) - 5]
    xg = rng.standard_normal((T, D)).astype(np.float32)
    with w.session(
        transport="grpc"
    ) as plain:  # gRPC chunks: the bytes the worker computes on, unchanged
        y_chunks = plain.matmul_sync(mat, x)
        g_chunks = plain.expert_group_sync(experts, rows, xg)
    with w.session(shm=True, doorbell=doorbell) as s:
        for _ in range(2):  # the second finds the segment registered (CuPy)
            y = s.matmul_sync(mat, x)
            np.testing.assert_array_equal(y, y_chunks)
            g = s.expert_group_sync(experts, rows, xg)
            np.testing.assert_array_equal(g, g_chunks)
        assert y.flags.writeable and y.shape == (S, OUT)
        if srv.servicer.backend.name == "cupy":
            from coliworker.server import cupy_segments

            assert [m.state for m in _segments(srv)] == [cupy_segments.REGISTERED]
    assert wait_for(lambda: _segments(srv) == [])
    assert rel_err(y_chunks, ref.matmul(mat_t, x)) < TOL
    want, start = [], 0
    for (gt, ut, dt), n in zip(tensors, rows, strict=True):
        want.append(ref.expert_mlp(gt, ut, dt, xg[start : start + n]))
        start += n
    assert rel_err(g_chunks, np.concatenate(want)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("worker", ["cupy"], indirect=True)
def test_close_while_registered_with_calls_in_flight(worker, rng):
    srv, w, mat_t, _, (mat, _) = worker
    xs = [rng.standard_normal((S, IN)).astype(np.float32) for _ in range(3)]
    with w.session(transport="grpc") as plain:
        want = [plain.matmul_sync(mat, x) for x in xs]
    s = w.session(shm=True)
    name = s.segment.name
    s.matmul_sync(mat, xs[0])  # registers the segment
    futs = [s.matmul(mat, x) for x in xs]
    s.close(timeout=0.001)  # the stream ends with calls in flight or just answered
    for f in futs:
        try:
            f.result(60)
        except Exception:
            pass  # cancelled by the close: fine, the worker must just stay sound
    assert wait_for(lambda: _segments(srv) == [])
    assert wait_for(lambda: not mapped(name))
    with w.session(shm=True) as again:  # the worker goes on, exact, with a fresh segment
        for x, y in zip(xs, want, strict=True):
            np.testing.assert_array_equal(again.matmul_sync(mat, x), y)
    assert rel_err(want[1], ref.matmul(mat_t, xs[1])) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("worker", ["cupy"], indirect=True)
def test_falls_back_when_registration_fails(worker, rng, monkeypatch):
    import cupy

    from coliworker.server import cupy_segments

    srv, w, mat_t, _, (mat, _) = worker

    def refuse(ptr, size, flags):
        raise cupy.cuda.runtime.CUDARuntimeError(1)  # cudaErrorInvalidValue

    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refuse)
    x = rng.standard_normal((S, IN)).astype(np.float32)
    with w.session(transport="grpc") as plain:
        want = plain.matmul_sync(mat, x)
    with w.session(shm=True) as s:
        np.testing.assert_array_equal(s.matmul_sync(mat, x), want)
        assert [m.state for m in _segments(srv)] == [cupy_segments.FAILED]
        np.testing.assert_array_equal(s.matmul_sync(mat, x), want)
    assert rel_err(want, ref.matmul(mat_t, x)) < TOL
    assert wait_for(lambda: _segments(srv) == [])


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from coliworker.client import WorkerClient
    w = WorkerClient(sys.argv[1], progress=False)
    rng = np.random.default_rng()
    m = rng.standard_normal((64, 64)).astype(np.float32)
    t = w.upload(m, None, fmt=0, in_features=64, out_features=64)
    s = w.session(shm=True)
    x = rng.standard_normal(((9 << 20) // 256, 64)).astype(np.float32)
    y = s.matmul_sync(t, x)
    assert np.abs(y - x @ m.T).max() < 1e-3
    print(s.segment.name, flush=True)
    time.sleep(600)
    """
)


def test_killed_client_leaves_no_registered_segment(worker):
    srv = worker[0]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, srv.address], stdout=subprocess.PIPE, text=True
    )
    try:
        name = child.stdout.readline().strip()
        assert name.startswith(f"coliworker-{child.pid}-")
        assert mapped(name)
        assert len(_segments(srv)) == (1 if srv.servicer.backend.name == "cupy" else 0)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_for(lambda: name not in srv.servicer.sessions.attached_segments())
        assert wait_for(lambda: not mapped(name))
        assert _segments(srv) == []
        assert not os.path.exists(os.path.join(shm_mod.shm_dir(), name))
    finally:
        child.kill()
        child.stdout.close()
