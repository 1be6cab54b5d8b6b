"""The MLA attention ops (kernels/attention_call.py, their launches kernels/attention.py)
through CupyBackend against the float64 reference. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import REL_TOL, make_tensor, rel_err

from coliworker.kernels import reference


def _mla(rng, b, h, q, r, v, k, d_out, fmt, gs):
    kv_b = make_tensor(rng, fmt, h * (q + v), k, gs)
    o_proj = make_tensor(rng, fmt, d_out, h * v, gs) if d_out else None
    return kv_b, o_proj, b.place(kv_b, 0), (b.place(o_proj, 0) if o_proj else None)


def _ragged_caches(b, rng, lens, k, r, lat_scale=1.0, halves=False, spread=0):
    """A KV cache on device 0 per length in ``lens``, holding fresh random rows (appended in
    two halves with ``halves``: the cache grows twice, copying on the second growth; each
    latent row times 2^-spread .. 2^spread with ``spread``); returns (caches, latents,
    ropes)."""
    caches, lats, ropes = [], [], []
    for n in lens:
        c = b.new_kv(0, k, r)
        lat = rng.standard_normal((n, k)) * lat_scale
        if spread:
            lat *= np.exp2(rng.integers(-spread, spread + 1, (n, 1)))
        lat = lat.astype(np.float32)
        rope = rng.standard_normal((n, r)).astype(np.float32)
        if halves:
            c.append(lat[: n // 2], rope[: n // 2])
            c.append(lat[n // 2 :], rope[n // 2 :])
        else:
            c.append(lat, rope)
        caches.append(c)
        lats.append(lat)
        ropes.append(rope)
    return caches, lats, ropes


@pytest.mark.gpu
@pytest.mark.parametrize("absorb_w", [False, True], ids=["absorb", "absorb_w"])
@pytest.mark.parametrize("fmt,gs", [(0, 0), (2, 0), (3, 0), (4, 5), (4, 8)])
@pytest.mark.parametrize("s,t", [(1, 1), (3, 40), (4, 300), (10, 20)])
def test_attention_batch(cupy_backend, rng, monkeypatch, absorb_w, fmt, gs, s, t):
    """mla_absorb and mla_absorb_w (fmt 2 and fmt 4 with gs % 4 == 0; the others keep
    mla_absorb) against float64, 1 to 10 tokens (mla_absorb_w's SB = 1, 4, 8, two z blocks)."""
    from coliworker.kernels import attention

    monkeypatch.setattr(attention, "ABSORB_W", absorb_w)
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
    caches, lats, ropes = _ragged_caches(b, rng, [4096, 7, 1000], k, r, halves=True)
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


@pytest.fixture(params=["flash", "fp32", "new", "new-kp4", "f16"])
def attention_path(request, monkeypatch):
    """mla_flash + mla_merge, mla_attend + mla_merge, the new kernels (mla_absorb_w,
    mla_flash_c with its clusters chosen as FL_CLUSTER = None chooses them) with 8 flash warps
    (KP 2) or 16 (KP 4), or those with the fp16 flash kernels (mla_flash_h / mla_flash_hc)."""
    from coliworker.kernels import attention

    monkeypatch.setattr(attention, "FLASH", request.param != "fp32")
    monkeypatch.setattr(attention, "FL_F16", request.param == "f16")
    monkeypatch.setattr(attention, "FL_KP", 4 if request.param == "new-kp4" else 2)
    if request.param in ("new", "new-kp4", "f16"):
        monkeypatch.setattr(attention, "ABSORB_W", True)
        monkeypatch.setattr(attention, "FL_CLUSTER", None)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize(
    "h,q,r,v,k",
    [(3, 16, 8, 12, 40), (70, 5, 3, 4, 9), (64, 192, 64, 256, 512), (4, 24, 8, 16, 1100)],
)
def test_attention_ragged_both_paths(cupy_backend, rng, attention_path, h, q, r, v, k):
    """mla_flash (tensor cores, split tf32), mla_flash_h (fp16 parts) and mla_attend (fp32)
    against float64: ragged lengths (1, under one tile, several slices), heads beyond one
    64-head block, odd widths."""
    b = cupy_backend
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 40, 2, 0)
    lens = [1, 15, 700, 2051]
    caches, lats, ropes = _ragged_caches(b, rng, lens, k, r, lat_scale=3)
    qa = rng.standard_normal((len(lens), h, q + r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    for op, dop in ((None, None), (o_proj, do)):
        res = b.attention_ragged(dk, dop, qa, caches, q, r, v, scale)
        ref = reference.attention_ragged(kv_b, op, qa, lats, ropes, q, r, v, scale)
        assert rel_err(res.out, ref) < 1e-5, attention_path


@pytest.mark.gpu
@pytest.mark.parametrize(
    "f16,kp", [(False, 2), (False, 4), (True, 2)], ids=["tf32", "tf32-kp4", "f16"]
)
@pytest.mark.parametrize(
    "nsplit,cluster",
    [(8, None), (4, None), (6, None), (32, 2), (32, 1), (1, None), (132, None), (132, 4), (16, 8)],
)
def test_flash_clusters(cupy_backend, rng, monkeypatch, nsplit, cluster, f16, kp):
    """mla_flash_c at GLM-5.2 widths: clusters of C T slices merged in distributed shared
    memory, into cl where C == nsplit (no mla_merge), else into partials for mla_merge
    (nsplit 6 as chosen: C = 2; 132 forced to C = 4; 16 to C = 8), and mla_flash (C = 1: 132
    as chosen, 3 x 132 blocks are more than one wave of clusters) as before, against
    float64; their partials merged by mla_merge<1>, or (f16) mla_merge<4> from 16 on; the tf32
    kernels with 8 warps (KP 2) and 16 (KP 4)."""
    from coliworker.kernels import attention

    monkeypatch.setattr(attention, "FL_KP", kp)
    monkeypatch.setattr(attention, "flash_splits", lambda *a: nsplit)
    monkeypatch.setattr(attention, "FL_CLUSTER", cluster)
    monkeypatch.setattr(attention, "FL_F16", f16)
    monkeypatch.setattr(attention, "ABSORB_W", True)
    monkeypatch.setattr(attention, "MERGE_ZG", f16)  # mla_merge<4> from 16 partials on
    b = cupy_backend
    h, q, r, v, k = 64, 192, 64, 256, 512
    kv_b, _, dk, _ = _mla(rng, b, h, q, r, v, k, 0, 2, 0)
    caches, lats, ropes = _ragged_caches(b, rng, (2051, 1, 300), k, r)
    qa = rng.standard_normal((3, h, q + r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    res = b.attention_ragged(dk, None, qa, caches, q, r, v, scale)
    ref = reference.attention_ragged(kv_b, None, qa, lats, ropes, q, r, v, scale)
    assert rel_err(res.out, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("lat_scale,spread", [(1e4, 0), (1e-4, 0), (1e-8, 0), (1.0, 12)])
def test_flash_f16_scales(cupy_backend, rng, monkeypatch, lat_scale, spread):
    """mla_flash_h at GLM-5.2 widths with latents far outside fp16's range and 1e-8 times the
    rope (each segment's power of two brings it in, the latent's apart from the rope's) and
    with cache rows 2^-spread .. 2^spread apart within a tile (P's scale per row), the scores
    then from the rope alone, against float64. Latents 1e4 take q_nope 1e-4 times: scores of
    ~1e5 would make the softmax so sharp that one float32 rounding of a latent (2^-24) moves
    the exact result by up to 4e-4 on about one draw in ten, past any float32 kernel's 1e-5."""
    from coliworker.kernels import attention

    monkeypatch.setattr(attention, "FL_F16", True)
    b = cupy_backend
    h, q, r, v, k = 64, 192, 64, 256, 512
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 40, 2, 0)
    caches, lats, ropes = _ragged_caches(b, rng, (300, 33), k, r, lat_scale, spread=spread)
    qa = rng.standard_normal((2, h, q + r)).astype(np.float32)
    if lat_scale > 1:
        qa[:, :, :q] /= lat_scale  # scores of order 1 (a well-conditioned softmax)
    if spread:
        qa[:, :, :q] = 0  # q_nope zero: the scores from the rope
    scale = 1 / np.sqrt(q + r)
    for op, dop in ((None, None), (o_proj, do)):
        res = b.attention_ragged(dk, dop, qa, caches, q, r, v, scale)
        ref = reference.attention_ragged(kv_b, op, qa, lats, ropes, q, r, v, scale)
        assert rel_err(res.out, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("f16", [False, True], ids=["tf32", "f16"])
def test_new_kernels_graph_replay(cupy_backend, rng, monkeypatch, f16):
    """mla_absorb_w and mla_flash_c (clusters into partials, then mla_merge; and into cl) in a
    captured graph give the bits of their direct launches (test_graphs.py does this for the
    default kernels)."""
    from coliworker.kernels import attention
    from coliworker.kernels import graphs as cupy_graphs

    monkeypatch.setattr(attention, "ABSORB_W", True)
    monkeypatch.setattr(attention, "FL_CLUSTER", None)
    monkeypatch.setattr(attention, "FL_F16", f16)
    b = cupy_backend
    h, q, r, v, k = 64, 192, 64, 256, 512
    kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 40, 2, 0)
    scale = 1 / np.sqrt(q + r)
    for lens in ([700, 3, 1500], [1000] * 32):  # nsplit 40 (C 8, 5 partials); 4 (C 4, cl)
        caches, _, _ = _ragged_caches(b, rng, lens, k, r)
        qa = rng.standard_normal((len(lens), h, q + r)).astype(np.float32)
        outs = []
        for on in (True, False):
            monkeypatch.setattr(cupy_graphs, "ENABLED", on)
            outs.append([b.attention_ragged(dk, do, qa, caches, q, r, v, scale).out
                         for _ in range(4)])  # fmt: skip
        assert sum(e is not None for a in b._arenas(0) for e in a.graphs.execs.values()) > 0
        for got in outs[0] + outs[1][1:]:
            assert np.array_equal(got.view(np.uint32), outs[1][0].view(np.uint32))
        for c in caches:
            c.release()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4096], [700, 3, 1500, 1, 2051, 15, 300, 33]], ids=["1", "8"])
def test_qsplit_fused_same_bits(cupy_backend, rng, monkeypatch, lens):
    """The q rows split by mla_absorb_w itself (``QSPLIT_FUSED``: no mla_qsplit launch) give the
    bits of the mla_qsplit launch at GLM-5.2 widths, 1 and 8 sequences, each call carrying a
    new cache row per sequence, with o_proj and without, kv_b in fmt 2 and fmt 4; both within
    1e-5 of float64."""
    from coliworker.kernels import attention

    monkeypatch.setattr(attention, "FL_F16", True)
    monkeypatch.setattr(attention, "ABSORB_W", True)
    b = cupy_backend
    h, q, r, v, k = 64, 192, 64, 256, 512
    scale = 1 / np.sqrt(q + r)
    for fmt, gs in ((2, 0), (4, 64)):
        kv_b, o_proj, dk, do = _mla(rng, b, h, q, r, v, k, 40, fmt, gs)
        caches, lats, ropes = _ragged_caches(b, rng, [n - 1 for n in lens], k, r)
        qa = rng.standard_normal((len(lens), h, q + r)).astype(np.float32)
        new = [(rng.standard_normal((1, k)).astype(np.float32),
                rng.standard_normal((1, r)).astype(np.float32)) for _ in lens]  # fmt: skip
        outs = {}
        for fused in (True, False):
            monkeypatch.setattr(attention, "QSPLIT_FUSED", fused)
            assert attention.qsplit_fused(dk.spec, r) == fused
            outs[fused] = []
            for op, dop in ((None, None), (o_proj, do)):
                res = b.attention_ragged(dk, dop, qa, caches, q, r, v, scale, rows=new)
                for c, n in zip(caches, lens, strict=True):
                    assert c.length == n
                    c.truncate(n - 1)
                full_l = [np.concatenate([la, x[0]]) for la, x in zip(lats, new, strict=True)]
                full_r = [np.concatenate([ro, x[1]]) for ro, x in zip(ropes, new, strict=True)]
                ref = reference.attention_ragged(kv_b, op, qa, full_l, full_r, q, r, v, scale)
                assert rel_err(res.out, ref) < 1e-5, (fmt, fused)
                outs[fused].append(res.out)
        for got, want in zip(outs[True], outs[False], strict=True):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), fmt
        for c in caches:
            c.release()
