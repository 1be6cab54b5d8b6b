"""attention.cu's flash and merge kernels on the CPU, no GPU needed (CI runs them):
mla_flash, mla_flash_c, mla_flash_h, mla_flash_hc and mla_merge against float64, their CUDA
source run with one fiber per CUDA thread, the inline PTX modelled (``_attention_cpu``); and
kernels/attention.py's host choices around them: flash clusters, the tiles of a slice,
mla_flash_h's geometry, the q split done by the absorb. The absorb kernels:
``test_attention_cpu.py``; the GPU tests of the same kernels: ``test_attention.py``."""

from __future__ import annotations

import functools
import shutil
import types

import pytest
from _attention_cpu import FIBER_SHIM, cpu_source
from _emulate import build_and_run

from coliworker.kernels import sources

# mla_flash, mla_flash_c, mla_flash_h, mla_flash_hc and mla_merge against float64.
_FLASH_SHIM = (
    FIBER_SHIM
    + r"""
int run(int H, std::vector<int> lens, int nsplit, int C, bool f16 = false, int K = 512,
        int R = 64, float lat_scale = 3, int spread = 0, int kp = 2) {
    const int KR = K + R, S = (int)lens.size();
    const int QST = f16 ? 584 : 580, KST = QST, nhb = (H + 63) / 64;
    const float scale = 1.f / std::sqrt(256.f);
    std::mt19937 rng(nsplit * 31 + C + H);
    std::normal_distribution<float> nd;
    std::vector<float> qf((size_t)S * H * KR);
    for (auto &x : qf) x = nd(rng);
    for (size_t i = 0; spread && i < qf.size(); ++i)  // scores from the rope alone
        if (i % KR < (size_t)K) qf[i] = 0;
    std::vector<std::vector<float>> lat(S), rop(S);
    std::vector<KvDesc> kv(S);
    for (int s = 0; s < S; ++s) {
        lat[s].resize((size_t)lens[s] * K); rop[s].resize((size_t)lens[s] * R);
        for (auto &x : lat[s]) x = lat_scale * nd(rng);
        for (int t = 0; spread && t < lens[s]; ++t) {  // rows 2^-spread .. 2^spread apart
            const float f = std::ldexp(1.f, (int)(rng() % (2 * spread + 1)) - spread);
            for (int c = 0; c < K; ++c) lat[s][(size_t)t * K + c] *= f;
        }
        for (auto &x : rop[s]) x = nd(rng);
        kv[s] = {(unsigned long long)lat[s].data(), (unsigned long long)rop[s].data(), lens[s], 0};
    }
    std::vector<float> pm((size_t)S * H * nsplit, NAN), pl = pm;
    std::vector<float> pacc((size_t)S * H * nsplit * K, NAN);
    std::vector<float> cl((size_t)H * S * K, NAN);
    auto args = [&](auto kern) {
        return [&, kern] {
            kern(pm.data(), pl.data(), pacc.data(), qf.data(), kv.data(), cl.data(), S, H, K, R,
                 scale, nsplit, QST, KST);
        };
    };
    const int KRP = (K + 15) / 16 * 16 + (R + 15) / 16 * 16;
    std::vector<unsigned short> qs((size_t)S * H * 2 * KRP);
    std::vector<int> qe((size_t)S * H * 2);
    if (f16)
        launch({(S * H + 7) / 8, 1, 1}, 1, 256,
               [&] { mla_qsplit(qs.data(), qe.data(), qf.data(), S * H, K, R, KRP); });
    auto hargs = [&](auto kern) {
        return [&, kern] {
            kern(pm.data(), pl.data(), pacc.data(), qs.data(), kv.data(), cl.data(), qe.data(),
                 S, H, K, R, scale, nsplit, QST, KST);
        };
    };
    if (f16 && K == 512) {
        if (C == 1) launch({nsplit, S, nhb}, 1, 256, hargs(mla_flash_h<32>));
        else if (C == 2) launch({nsplit, S, nhb}, 2, 256, hargs(mla_flash_hc<32, 2>));
        else launch({nsplit, S, nhb}, 8, 256, hargs(mla_flash_hc<32, 8>));
    } else if (f16 && K <= 16) {
        launch({nsplit, S, nhb}, 1, 256, hargs(mla_flash_h<1>));  // one n-tile a half
    } else if (f16) {
        launch({nsplit, S, nhb}, 1, 256, hargs(mla_flash_h<4>));  // K <= 64
    } else if (kp == 4) {  // 16 warps, four k parts
        if (C == 1) launch({nsplit, S, nhb}, 1, 512, args(mla_flash<16, 4>));
        else if (C == 2) launch({nsplit, S, nhb}, 2, 512, args(mla_flash_c<16, 2, 4>));
        else if (C == 4) launch({nsplit, S, nhb}, 4, 512, args(mla_flash_c<16, 4, 4>));
        else launch({nsplit, S, nhb}, 8, 512, args(mla_flash_c<16, 8, 4>));
    } else if (C == 1) launch({nsplit, S, nhb}, 1, 256, args(mla_flash<32, 2>));
    else if (C == 2) launch({nsplit, S, nhb}, 2, 256, args(mla_flash_c<32, 2, 2>));
    else if (C == 4) launch({nsplit, S, nhb}, 4, 256, args(mla_flash_c<32, 4, 2>));
    else launch({nsplit, S, nhb}, 8, 256, args(mla_flash_c<32, 8, 2>));
    // the partials merged by mla_merge<4> (into cl4) and mla_merge<1> (into cl), both checked
    const int nz = nsplit / C;
    std::vector<float> cl4;
    if (!(C > 1 && nz == 1)) {
        const std::vector<float> cl0 = cl;
        launch({H, S, (K + 31) / 32}, 1, 128,
               [&] { mla_merge<4>(cl.data(), pm.data(), pl.data(), pacc.data(), S, H, K, nz); });
        cl4.swap(cl);
        cl = cl0;
        launch({H, S, (K + 127) / 128}, 1, 128,
               [&] { mla_merge<1>(cl.data(), pm.data(), pl.data(), pacc.data(), S, H, K, nz); });
    }
    double md = 0, mx = 0; long nan = 0;
    for (int s = 0; s < S; ++s)
        for (int h = 0; h < H; ++h) {
            const int T = lens[s];
            std::vector<double> sc(T), o(K, 0.0);
            double m = -1e300, l = 0;
            for (int t = 0; t < T; ++t) {
                double v = 0;
                const float *qr = &qf[((size_t)s * H + h) * KR];
                for (int c = 0; c < K; ++c) v += (double)qr[c] * lat[s][(size_t)t * K + c];
                for (int c = 0; c < R; ++c) v += (double)qr[K + c] * rop[s][(size_t)t * R + c];
                sc[t] = v * scale; m = std::max(m, sc[t]);
            }
            for (int t = 0; t < T; ++t) { sc[t] = std::exp(sc[t] - m); l += sc[t]; }
            for (int t = 0; t < T; ++t)
                for (int c = 0; c < K; ++c) o[c] += sc[t] * lat[s][(size_t)t * K + c];
            for (int c = 0; c < K; ++c)
                for (const std::vector<float> *out : {&cl, &cl4}) {
                    if (out->empty()) continue;
                    const float g = (*out)[((size_t)h * S + s) * K + c];
                    if (std::isnan(g)) { ++nan; continue; }
                    md = std::max(md, std::fabs(g - o[c] / l));
                    mx = std::max(mx, std::fabs(o[c] / l));
                }
        }
    printf("%s KP %d H %d S %d K %d nsplit %d C %d: rel err %.2g, unwritten %ld\n",
           f16 ? "fp16" : "tf32", f16 ? 2 : kp, H, S, K, nsplit, C, md / mx, nan);
    return nan > 0 || md > 1e-5 * mx;
}

int main() {
    // clusters into cl (an empty sequence beside), partials + mla_merge over two head blocks
    // (heads beyond H), C = 4 and C = 8 (slices without rows), no clusters (C = 1), each with
    // 8 warps (KP 2) and with 16 (KP 4)
    // (every merge by mla_merge<1> and mla_merge<4>)
    // mla_flash_h (fp16 parts): the same, K = 11 and 12 (one n-tile a half; odd widths: scalar
    // loads), latents 1e4, 1e-6 and 1e-8 times the rope (each segment's scale; K = 40: the rope
    // staged from column 48), rows 2^-12 .. 2^12 apart in one tile (P's scale per row)
    return run(64, {40, 1}, 2, 2) + run(70, {70}, 4, 2) + run(64, {50}, 4, 4) +
           run(64, {33, 1}, 8, 8) + run(64, {33}, 2, 1) +
           run(64, {40, 1}, 2, 2, false, 512, 64, 3, 0, 4) +
           run(64, {33, 1}, 8, 8, false, 512, 64, 3, 0, 4) +
           run(70, {40, 17}, 4, 1, false, 512, 64, 3, 0, 4) + run(64, {40, 1}, 2, 2, true) +
           run(70, {70, 17}, 4, 1, true) +
           run(64, {33, 1}, 8, 8, true) + run(5, {20, 3}, 2, 1, true, 12, 4) +
           run(3, {37}, 2, 1, true, 11, 3) + run(64, {90}, 2, 1, true, 512, 64, 1e4f) +
           run(64, {90}, 2, 1, true, 512, 64, 1e-6f) + run(64, {90}, 2, 1, true, 512, 64, 1e-8f) +
           run(64, {70}, 2, 1, true, 512, 64, 3, 12) + run(4, {40}, 2, 1, true, 40, 8, 1e-8f) +
           run(70, {300, 5}, 20, 1, true);  // 20 splits: mla_merge<4>'s warps, 5 splits each
}
"""
)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_flash_clusters_on_cpu(tmp_path):
    """mla_flash (C = 1) and mla_flash_c (C = 2, 4, 8: into cl, and into partials for
    mla_merge; two head blocks, heads beyond H, slices without rows), with 8 warps (KP 2) and 16
    (KP 4), against float64 at GLM-5.2 widths (K 512, R 64), their
    CUDA source run on the CPU (``_FLASH_SHIM``): every output written, within 1e-5 (~1e-6)."""
    build_and_run(tmp_path, _FLASH_SHIM, cpu_source(sources.source("attention.cu")), 420)


@pytest.fixture
def attention_host(host_module):
    """kernels/attention.py's pure host functions where CuPy is absent."""
    return host_module("attention")


def test_cluster_choice_keeps_one_wave(attention_host, rng):
    """cluster_choice against a search of every (C, nsplit'): the largest C whose clusters
    all fit at once with nsplit' a multiple of C, at most nsplit rounded up to one and within
    FL_WAVE_LOSS below it (and, given the tiles of the longest slice, none more than at
    nsplit), then the largest such nsplit';
    else (1, nsplit); and cluster_for at the chosen nsplit gives the chosen C. The H200's
    resident counts at GLM-5.2 widths (66, 30, 15 for C = 2, 4, 8) give, at one sequence of
    T = 4096, C = 2 on 128 slices (2 tiles each; C = 8 on 120 would make them 3), and C = 8 on
    120 without the tiles; C = 2 at 8 and 32 sequences."""
    att = attention_host
    h200 = {2: 66, 4: 30, 8: 15}.get
    t4096 = functools.partial(att.slice_tiles, 4096)
    assert (t4096(128), t4096(120)) == (2, 3)
    assert att.cluster_choice(1, 128, (2, 4, 8), h200, t4096) == (2, 128)
    assert att.cluster_choice(1, 128, (2, 4, 8), h200) == (8, 120)
    assert att.cluster_choice(8, 16, (2, 4, 8), h200, functools.partial(att.slice_tiles, 4096)) == (
        2,
        16,
    )
    assert att.cluster_choice(32, 4, (2, 4, 8), h200, functools.partial(att.slice_tiles, 2048)) == (
        2,
        4,
    )
    assert att.cluster_choice(1, 128, (2, 4, 8), lambda c: 0) == (1, 128)
    # T = 4097: one-wave nsplit 129 (2 tiles a slice); 128 slices would take 3 (48 rows), 130
    # keep 2: clusters of 2 on 130, not mla_flash on 129 (flash + merge 41 against 54 us)
    t4097 = functools.partial(att.slice_tiles, 4097)
    assert att.cluster_choice(1, 129, (2, 4, 8), h200, t4097) == (2, 130)
    for _ in range(600):
        per, nsplit = int(rng.integers(1, 40)), int(rng.integers(1, 200))
        sizes = tuple(sorted({int(c) for c in rng.choice([2, 4, 8], int(rng.integers(0, 4)))}))
        resident = {c: int(rng.integers(0, 80)) for c in (2, 4, 8)}
        t_max = int(rng.integers(1, 9000))
        for tiles in (None, functools.partial(att.slice_tiles, t_max)):
            fits = [(c, n) for c in sizes for n in range(c, -(-nsplit // c) * c + 1, c)
                    if per * n <= resident[c] * c and n >= (1 - att.FL_WAVE_LOSS) * nsplit
                    and (tiles is None or tiles(n) <= tiles(nsplit))]  # fmt: skip
            want = max(fits) if fits else (1, nsplit)
            got = att.cluster_choice(per, nsplit, sizes, resident.get, tiles)
            assert got == want, (per, nsplit, t_max, tiles is None)
            if got[0] > 1:
                assert att.cluster_for(per, got[1], sizes, resident.get) == got[0]


def test_flash_splits_is_cluster_choice(attention_host, monkeypatch, rng):
    """flash_splits, which keeps cluster_choice's candidates (they do not depend on T) and
    applies only the tile rule to a new T, gives cluster_choice's nsplit from scratch: every T
    of a decode walk past 4096 and random shapes, on made-up resident counts and cluster
    sizes, with the candidates kept across calls."""
    att = attention_host
    resident = {2: 66, 4: 30, 8: 15}
    sizes = (2, 4, 8)
    monkeypatch.setattr(att, "_cluster_sizes", lambda k, r: sizes)
    monkeypatch.setattr(att, "_max_clusters", lambda k, r, c: resident[c])
    monkeypatch.setattr(att, "FL_CLUSTER", None)
    att._splits.clear()
    att._candidates.clear()

    def scratch(s, heads, t_max, n_sm):
        per = s * -(-heads // att.FL_HB)
        n = max(1, min(max(1, n_sm // per), -(-t_max // att.FL_MIN_ROWS), 1024))
        return att.cluster_choice(per, n, sizes, resident.get,
                                  functools.partial(att.slice_tiles, t_max))[1]  # fmt: skip

    seen = set()
    for t in range(4000, 4400):
        got = att.flash_splits(1, 64, t, 132, 512, 64)
        assert got == scratch(1, 64, t, 132), t
        seen.add(got)
    assert len(seen) > 1  # the walk crosses nsplit changes
    for _ in range(400):
        s, heads = int(rng.integers(1, 40)), int(rng.choice([16, 64, 128]))
        t, n_sm = int(rng.integers(1, 9000)), int(rng.choice([78, 114, 132]))
        assert att.flash_splits(s, heads, t, n_sm, 512, 64) == scratch(s, heads, t, n_sm)
    att._splits.clear()
    att._candidates.clear()


def test_slice_tiles_is_the_kernels_chunk(attention_host, rng):
    """slice_tiles: the tiles of mla_flash's longest slice, chunk = ceil(ceil(T / nsplit) /
    FL_TT) * FL_TT rows (attention_flash.cuh), for random T and nsplit."""
    att = attention_host
    for _ in range(500):
        t, n = int(rng.integers(1, 20000)), int(rng.integers(1, 300))
        chunk = ((t + n - 1) // n + att.FL_TT - 1) // att.FL_TT * att.FL_TT
        assert att.slice_tiles(t, n) == chunk // att.FL_TT


def test_flash_f16_geometry(attention_host):
    """mla_flash_h's row layout and shared memory (attention_flash_h.cuh): the latent and the rope
    each padded to 16 columns (KRP), row strides 8 mod 16 fp16 values (conflict-free ldmatrix
    rows, 16-byte aligned), the two planes of 64 q rows and one tile, Ss and the exponents; rows
    wider than the staging's FH_MAX_W and shared memory past the limit keep the tf32 kernel."""
    att = attention_host
    assert att.krp16(512, 64) == 576 and att.krp16(40, 8) == 64 and att.krp16(11, 3) == 32
    for k, r in ((512, 64), (40, 8), (11, 3), (256, 32), (500, 100)):
        geo = att._flash_geometry(k, r, True)
        assert geo is not None, (k, r)
        ntc, qst, kst, smem = geo
        krp = att.krp16(k, r)
        assert 16 * ntc >= k and (ntc == 1 or 8 * ntc < k)
        assert qst == krp + 8 and kst == max(krp, 16 * ntc) + 8
        assert qst % 16 == 8 and kst % 16 == 8  # 4 mod 8 words a row, rows 16-byte aligned
        want = 4 * (64 * qst + 16 * kst) + 4 * 2 * 64 * 16 + 8 * (64 + 16)
        assert smem == want <= att.FL_SMEM_MAX
    assert att._flash_geometry(512, 64, True)[3] == 195712
    assert att._flash_geometry(512, 144, True) is None  # 512 + 144 > FH_MAX_W = 640
    assert att._flash_geometry(512, 128, True) is not None
    assert att._flash_geometry(520, 64, True) is None  # K > 512: no NTC
    for ntc in (1, 2, 4, 8, 16, 32):  # every fp16 variant the host names is compiled
        assert att._flash_name(True, ntc, 1) in att.VARIANTS
    for w, cs in att.FL_CLUSTERS.items():
        assert all(att._flash_name(True, w // 16, c) in att.VARIANTS for c in cs)


@pytest.mark.parametrize("kp", [2, 4])
def test_flash_geometry(attention_host, kp):
    """mla_flash<NTC, KP>'s layout and shared memory (attention_flash.cuh): the KP parts' warps
    cover the latent (8 KP NTC columns, NTC the least that does), row strides 4 mod 8 floats,
    64 q rows, one tile and KP partial scores; every variant the host names, clustered or not,
    is compiled; a width it cannot cover keeps mla_attend."""
    att = attention_host
    for k, r in ((512, 64), (40, 8), (11, 3), (256, 32), (500, 100), (129, 7)):
        ntc, qst, kst, smem = att._flash_geometry(k, r, False, kp)
        krp = -(-(k + r) // 8) * 8
        assert 8 * kp * ntc >= k and (ntc == 1 or 4 * kp * ntc < k)
        assert qst == krp + 4 and kst == max(krp, 8 * kp * ntc) + 4 and qst % 8 == 4
        assert smem == 4 * (64 * qst + 16 * kst + kp * 64 * 16) <= att.FL_SMEM_MAX
        for c in (1, *att.FL_CLUSTERS.get(8 * kp * ntc, ())):
            assert att._flash_name(False, ntc, c, kp) in att.VARIANTS
    assert att._flash_geometry(520, 64, False, kp) is None  # K > 512: no NTC
    assert att._flash_geometry(512, 64, False, kp)[0] == 64 // kp


def test_flash_kp_setting(attention_host):
    """COLIWORKER_FLASH_KP's values: unset is the default, 2 or 4 as given, else an error
    naming the variable, the value and the choices."""
    att = attention_host
    assert att._flash_kp(None) in att.FL_KPS
    assert att._flash_kp("2") == 2 and att._flash_kp("4") == 4
    for bad in ("3", "", "four", "8"):
        with pytest.raises(ValueError, match=r"COLIWORKER_FLASH_KP=.*\(2, 4\)"):
            att._flash_kp(bad)


def test_qsplit_fused_choice(attention_host, monkeypatch):
    """qsplit_fused: the absorb splits the q rows itself (no mla_qsplit launch) where
    mla_absorb_w serves kv_b (fmt 2, fmt 4 with gs % 4 == 0), the flash launch is mla_flash_h's
    (K + R within FH_MAX_W) and K <= 512, with each switch it depends on on; every mla_absorb_w
    variant the host can name is compiled."""
    att = attention_host
    monkeypatch.setattr(att, "QSPLIT_FUSED", True)
    monkeypatch.setattr(att, "FL_F16", True)

    def spec(fmt, k, gs=0):
        return types.SimpleNamespace(fmt=fmt, in_features=k, group_size=gs)

    glm = spec(2, 512)
    assert att.qsplit_fused(glm, 64) and att.qsplit_fused(spec(4, 512, 64), 64)
    assert att.qsplit_fused(spec(2, 40), 24) and att.qsplit_fused(spec(4, 37, 8), 6)
    assert not att.qsplit_fused(spec(4, 512, 5), 64)  # mla_absorb
    assert not att.qsplit_fused(spec(0, 512), 64)
    assert not att.qsplit_fused(spec(2, 1100), 64)  # K > 512: mla_attend
    assert not att.qsplit_fused(glm, 144)  # K + R past FH_MAX_W: the tf32 flash
    for name in ("QSPLIT_FUSED", "FL_F16", "FLASH", "ABSORB_W"):
        with monkeypatch.context() as m:
            m.setattr(att, name, False)
            assert not att.qsplit_fused(glm, 64), name
    for fmt in (2, 4):
        for sb in att.ABW_SB:
            for fused in (False, True):
                assert f"mla_absorb_w<{fmt}, {sb}, {str(fused).lower()}>" in att.VARIANTS
