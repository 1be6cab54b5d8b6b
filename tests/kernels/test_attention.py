"""The MLA attention ops (kernels/attention.py) through CupyBackend against the float64
reference. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import REL_TOL, make_tensor, rel_err

from coliworker.kernels import reference


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
