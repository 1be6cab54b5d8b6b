"""The CUDA kernels (through CupyBackend) against the float64 reference, and the resident layout.

The layout test runs everywhere (NumPy model of the kernels' decode); the rest is ``gpu``.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from coliworker.kernels import layout, reference
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count

REL_TOL = 1e-3


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def make_tensor(rng: np.random.Generator, fmt: int, o: int, i: int, gs: int = 0) -> QTensor:
    if fmt == 0:
        w = rng.standard_normal((o, i)).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        w = rng.integers(0, 256, o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.02 + 0.005).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


FMT_GS = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 64), (4, 128), (4, 3), (4, 5), (4, 6)]


@pytest.mark.parametrize("fmt,gs", FMT_GS)
@pytest.mark.parametrize("i", [1, 7, 33, 130, 1025, 2100])
def test_layout_decode_matches_reference(rng, fmt, gs, i):
    t = make_tensor(rng, fmt, 3, i, gs)
    dev = layout.relayout(np, t, t.weights)
    sc = layout.scales(np, t, t.scales)
    assert dev.size == 3 * layout.Layout.of(fmt, i, gs).ld
    assert np.array_equal(layout.decode_resident(t, dev, sc), reference.dequantize(t))


@pytest.fixture
def cupy_backend():
    from coliworker.server.backend_cupy import CupyBackend

    b = CupyBackend((0,))
    yield b
    b.close()


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


def _experts(b, rng, n, d, ie, fmt, gs):
    host = [
        tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
        for _ in range(n)
    ]
    dev = [tuple(b.place(t, 0) for t in e) for e in host]
    return host, dev


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(0, 0), (1, 0), (2, 0), (3, 0), (4, 64), (4, 5)])
def test_expert_group_issue_is_bit_identical(cupy_backend, rng, fmt, gs):
    b = cupy_backend
    host, dev = _experts(b, rng, 5, 96, 40, fmt, gs)
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
    host, dev = _experts(b, rng, 8, 6144, 2048, fmt, gs)
    x = np.repeat(rng.standard_normal((1, 6144)).astype(np.float32), 8, axis=0)
    res = b.expert_group(dev, [1] * 8, x)
    assert rel_err(res.out, reference.expert_group(host, [1] * 8, x)) < REL_TOL
    kern = min(b.expert_group(dev, [1] * 8, x).phases.kernel_ns for _ in range(20))
    print(f"GLM-5.2 decode 8x1 fmt {fmt}: kernel {kern / 1e3:.1f} us")


@pytest.mark.gpu
def test_expert_group_routed(cupy_backend, rng):
    b = cupy_backend
    host, dev = _experts(b, rng, 6, 64, 48, 4, 32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    routes = rng.integers(0, 6, (5, 3)).astype(np.int32)
    w = rng.random((5, 3)).astype(np.float32)
    res = b.expert_group_routed(dev, x, routes, w)
    assert rel_err(res.out, reference.expert_group_routed(host, x, routes, w)) < REL_TOL


def _mla(rng, b, h, q, r, v, k, d_out, fmt, gs):
    kv_b = make_tensor(rng, fmt, h * (q + v), k, gs)
    o_proj = make_tensor(rng, fmt, d_out, h * v, gs) if d_out else None
    return kv_b, o_proj, b.place(kv_b, 0), (b.place(o_proj, 0) if o_proj else None)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(0, 0), (2, 0), (3, 0), (4, 5)])
@pytest.mark.parametrize("s,t", [(1, 1), (3, 40), (4, 300)])
def test_attention_batch(cupy_backend, rng, fmt, gs, s, t):
    b = cupy_backend
    h, q, r, v, k = 3, 16, 8, 12, 40
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 24, fmt, gs)
    qa = rng.standard_normal((s, h, q + r)).astype(np.float32)
    lat = rng.standard_normal((t + s - 1, k)).astype(np.float32)
    rope = rng.standard_normal((t + s - 1, r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    for op, dop in ((None, None), (o_proj, do)):
        res = b.attention(dk, dop, qa, lat, rope, q, r, v, scale)
        ref = reference.attention(kv_b, op, qa, lat, rope, q, r, v, scale)
        assert res.out.shape == ref.shape
        assert rel_err(res.out, ref) < REL_TOL


@pytest.mark.gpu
def test_attention_ragged_glm52(cupy_backend, rng):
    b = cupy_backend
    h, q, r, v, k = 64, 192, 64, 256, 512
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 6144, 2, 0)
    lens = [4096, 7, 1000]
    caches, lats, ropes = [], [], []
    for n in lens:
        c = b.new_kv(0, k, r)
        lat = rng.standard_normal((n, k)).astype(np.float32)
        rope = rng.standard_normal((n, r)).astype(np.float32)
        c.append(lat[: n // 2], rope[: n // 2])  # grows twice: copy on grow
        c.append(lat[n // 2 :], rope[n // 2 :])
        caches.append(c)
        lats.append(lat)
        ropes.append(rope)
    qa = rng.standard_normal((3, h, q + r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    res = b.attention_ragged(dk, do, qa, caches, q, r, v, scale)
    ref = reference.attention_ragged(kv_b, o_proj, qa, lats, ropes, q, r, v, scale)
    assert rel_err(res.out, ref) < REL_TOL
    caches[0].truncate(100)
    res = b.attention_ragged(dk, None, qa[:1], caches[:1], q, r, v, scale)
    ref = reference.attention_ragged(kv_b, None, qa[:1], [lats[0][:100]], [ropes[0][:100]],
                                     q, r, v, scale)  # fmt: skip
    assert rel_err(res.out, ref) < REL_TOL
    caches[0].append(lats[0][100:4096], ropes[0][100:4096])
    one = [caches[0]]
    kern = min(
        b.attention_ragged(dk, do, qa[:1], one, q, r, v, scale).phases.kernel_ns for _ in range(20)
    )
    print(f"GLM-5.2 MLA ragged + o_proj, 1 seq T=4096: kernel {kern / 1e3:.1f} us")


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

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
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
    host, dev = _experts(b, rng, len(rows), 1024, 512, fmt, gs)
    x = rng.standard_normal((sum(rows), 1024)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < REL_TOL


@pytest.fixture
def no_tensor_cores():
    from coliworker.kernels import matmul

    matmul.TENSOR_CORES = False
    yield
    matmul.TENSOR_CORES = True


TC_TOL = 1e-5  # the tensor-core path keeps fp32 activations (3-way bf16 split): ~1e-7 seen


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
@pytest.mark.parametrize("rows", [[1] * 8, [4] * 8, [2, 1, 4, 3]])
def test_tensor_core_expert_group_matches_both_paths(cupy_backend, rng, fmt, gs, rows):
    b = cupy_backend
    host, dev = _experts(b, rng, len(rows), 2048 + 64, 640, fmt, gs)
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
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_fp32_gemv_path_still_exact(cupy_backend, rng, no_tensor_cores, fmt, gs):
    t = make_tensor(rng, fmt, 70, 1025, gs)
    x = rng.standard_normal((3, 1025)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert rel_err(res.out, reference.matmul(t, x)) < REL_TOL


@pytest.fixture(params=[True, False], ids=["flash", "fp32"])
def attention_path(request):
    from coliworker.kernels import attention

    attention.FLASH = request.param
    yield request.param
    attention.FLASH = True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "h,q,r,v,k", [(3, 16, 8, 12, 40), (70, 5, 3, 4, 9), (64, 192, 64, 256, 512)]
)
def test_attention_ragged_both_paths(cupy_backend, rng, attention_path, h, q, r, v, k):
    """mla_flash (tensor cores, split tf32) and mla_attend (fp32) against float64: ragged
    lengths (1, under one tile, several slices), heads beyond one 64-head block, odd widths."""
    b = cupy_backend
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 40, 2, 0)
    lens = [1, 15, 700, 2051]
    caches, lats, ropes = [], [], []
    for n in lens:
        c = b.new_kv(0, k, r)
        lat = (rng.standard_normal((n, k)) * 3).astype(np.float32)
        rope = rng.standard_normal((n, r)).astype(np.float32)
        c.append(lat, rope)
        caches.append(c)
        lats.append(lat)
        ropes.append(rope)
    qa = rng.standard_normal((len(lens), h, q + r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    for op, dop in ((None, None), (o_proj, do)):
        res = b.attention_ragged(dk, dop, qa, caches, q, r, v, scale)
        ref = reference.attention_ragged(kv_b, op, qa, lats, ropes, q, r, v, scale)
        assert rel_err(res.out, ref) < 1e-5, attention_path
