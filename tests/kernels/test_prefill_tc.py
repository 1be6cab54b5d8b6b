"""The tensor-core prefill path (prefill_tc.cu: gemv_pf, moe_pf) against the float64 reference.

It serves int4 products (fmt 2, fmt 4 with group sizes that are multiples of 16) with more
than 4 activation rows: matmuls and expert groups here, through CupyBackend. Shapes cross every
tile edge: activation rows around the 32-row block (5, 17, 33, 64), weight rows not a multiple
of the 64/128/256-row tiles, in_features not a multiple of the 512-element K tile.
"""

from __future__ import annotations

import numpy as np
import pytest
from _kern import make_tensor, rel_err

from coliworker.kernels import reference

REL_TOL = 1e-3  # the acceptance bound of every product
# x = hi + lo in bf16 keeps ~16 significant bits: ~2e-6 in a NumPy model of the kernel. A lost lo
# column would show as ~1e-3, so this bound checks the split itself.
PF_TOL = 1e-4

FMT_GS = [(2, 0), (4, 16), (4, 64), (4, 128)]


@pytest.fixture
def fp32_path():
    """Runs the body with the fp32 kernels (gemv / moe) in place of the tensor-core ones."""
    from coliworker.kernels import matmul

    matmul.TENSOR_CORES = False
    yield
    matmul.TENSOR_CORES = True


def _experts(b, rng, n, d, ie, fmt, gs):
    host = [
        tuple(make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
        for _ in range(n)
    ]
    return host, [tuple(b.place(t, 0) for t in e) for e in host]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", FMT_GS)
@pytest.mark.parametrize("s", [5, 17, 33, 64])
@pytest.mark.parametrize("o,i", [(300, 2100), (300, 2101), (70, 512), (1000, 4096 + 96)])
def test_matmul_many_rows(cupy_backend, rng, fmt, gs, s, o, i):
    # Few weight tiles: gemv_pf's 64-row blocks (k slices meeting in shared memory). i = 2101:
    # rows not 16-byte aligned, staged element by element.
    t = make_tensor(rng, fmt, o, i, gs)
    x = rng.standard_normal((s, i)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert res.out.shape == (s, o)
    assert rel_err(res.out, reference.matmul(t, x)) < PF_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_matmul_prefill_rows_fill_the_device(cupy_backend, rng, fmt, gs):
    # 11 row blocks x 25 weight tiles of 256 rows: two blocks per SM of an H200 or more, so
    # gemv_pf runs 256-row blocks; rows 352 and 6184 end inside a tile.
    t = make_tensor(rng, fmt, 6184, 2100, gs)
    x = rng.standard_normal((352, 2100)).astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    assert rel_err(res.out, reference.matmul(t, x)) < PF_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 16)])
def test_matmul_wide_range_activations(cupy_backend, rng, fmt, gs):
    # Rows spanning 1e-30 .. 1e30: bf16 has fp32's exponent range, so no per-row scaling.
    t = make_tensor(rng, fmt, 200, 1500, gs)
    x = rng.standard_normal((9, 1500)) * 10.0 ** rng.uniform(-30, 30, (9, 1))
    x = x.astype(np.float32)
    res = cupy_backend.matmul(cupy_backend.place(t, 0), x)
    ref = reference.matmul(t, x)
    for k in range(9):
        assert rel_err(res.out[k], ref[k]) < PF_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", FMT_GS)
@pytest.mark.parametrize("rows", [[32, 0, 17, 5, 64, 1, 33, 0], [5] * 3, [0, 40, 0, 3], [64, 64]])
def test_expert_group_many_rows(cupy_backend, rng, fmt, gs, rows):
    # d = 1100 (K tiles of 512: one partial), ie = 300 (gate+up tiles of 128, down of 256).
    b = cupy_backend
    host, dev = _experts(b, rng, len(rows), 1100, 300, fmt, gs)
    x = rng.standard_normal((sum(rows), 1100)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < PF_TOL
    assert np.array_equal(res.out, b.expert_group(dev, rows, x).out)  # same bits every call


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_expert_group_fp32_path_agrees(cupy_backend, rng, fp32_path, fmt, gs):
    b = cupy_backend
    rows = [9, 0, 33]
    host, dev = _experts(b, rng, 3, 700, 200, fmt, gs)
    x = rng.standard_normal((sum(rows), 700)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_expert_group_glm52_prefill(cupy_backend, rng, fmt, gs):
    # GLM-5.2 shapes: D = 6144, I = 2048, 32 rows per expert.
    b = cupy_backend
    rows = [32] * 4
    host, dev = _experts(b, rng, 4, 6144, 2048, fmt, gs)
    x = rng.standard_normal((sum(rows), 6144)).astype(np.float32)
    res = b.expert_group(dev, rows, x)
    assert rel_err(res.out, reference.expert_group(host, rows, x)) < PF_TOL
    kern = min(b.expert_group(dev, rows, x).phases.kernel_ns for _ in range(10))
    print(f"GLM-5.2 prefill 4x32 fmt {fmt}: kernel {kern / 1e3:.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (4, 16)])
@pytest.mark.parametrize("s,o,i", [(8, 6144, 16384), (32, 6144, 16384), (17, 300, 2101),
                                   (33, 1000, 4096 + 96), (5, 70, 512)])  # fmt: skip
def test_matmul_split_k_clusters(cupy_backend, rng, monkeypatch, fmt, gs, s, o, i):
    # gemv_pf_sk: every (KS, C) against float64 and each other (the sums meet in another
    # order: not the same bits as gemv_pf), each the same bits on every call. i = 2101: K ends
    # inside an int4 block; i = 512 with C = 8: ranks with no K at all (their sums are zero).
    from coliworker.kernels import prefill_tc

    b = cupy_backend
    t = make_tensor(rng, fmt, o, i, gs)
    w = b.place(t, 0)
    x = rng.standard_normal((s, i)).astype(np.float32)
    ref = reference.matmul(t, x)
    for ks in (1, 4):
        for c in (1, 2, 4, 8):
            monkeypatch.setattr(prefill_tc, "PF_SK_FORCE", (ks, c))
            y = b.matmul(w, x).out
            assert rel_err(y, ref) < PF_TOL, (ks, c)
            assert np.array_equal(y, b.matmul(w, x).out), (ks, c)


@pytest.mark.gpu
def test_matmul_split_k_on_and_off(cupy_backend, rng, monkeypatch):
    # o_proj of 32 sequences: the host's choice with PF_SPLIT_K (K split over a cluster)
    # beside gemv_pf's k slices (PF_SPLIT_K off), both within the bound.
    from coliworker.kernels import prefill_tc

    b = cupy_backend
    t = make_tensor(rng, 2, 6144, 16384)
    w = b.place(t, 0)
    x = rng.standard_normal((32, 16384)).astype(np.float32)
    ref = reference.matmul(t, x)
    monkeypatch.setattr(prefill_tc, "PF_SPLIT_K", True)
    on = b.matmul(w, x).out
    monkeypatch.setattr(prefill_tc, "PF_SPLIT_K", False)
    off = b.matmul(w, x).out
    assert rel_err(on, ref) < PF_TOL and rel_err(off, ref) < PF_TOL
    assert not np.array_equal(on, off)  # another launch: the sums in another order


def test_pf_split_k_choice(monkeypatch):
    # The many-row gemv's (KS, C) model (no kernel compiled or run; matmul imports CuPy):
    # grids that fill the GPU twice over keep gemv_pf, smaller ones split K over a cluster
    # as far as one wave allows (short K: not split), and PF_SPLIT_K off keeps the k slices.
    pytest.importorskip("cupy")
    from coliworker.kernels import matmul, prefill_tc

    def choose(fmt, n_jobs, rows, out, k, n_sm=132):
        spec = matmul.WeightSpec.of(fmt, k, 64 if fmt == 4 else 0)
        return prefill_tc._pf_choice(spec, n_jobs, rows, out, n_sm)

    monkeypatch.setattr(prefill_tc, "PF_SPLIT_K", True)
    assert choose(2, 1, 32, 6144, 16384) == (1, 8)  # o_proj, 32 sequences: 24 tiles
    assert choose(2, 1, 8, 6144, 16384) == (1, 8)
    assert choose(2, 1, 352, 6184, 2100) == (1, 1)  # 11 x 25 tiles: two waves already
    assert choose(2, 64, 32, 256, 512) == (1, 1)  # value projection: 64 short jobs
    assert choose(4, 1, 32, 6144, 16384) == (1, 4)  # fmt 4: one block per SM
    monkeypatch.setattr(prefill_tc, "PF_SPLIT_K", False)
    assert choose(2, 1, 32, 6144, 16384) == (4, 1)
    assert choose(2, 1, 352, 6184, 2100) == (1, 1)
