"""moe_wq (moe_wq.cu) on the CPU, no GPU needed (CI runs it): its CUDA source under g++
through fibers.h, every block of a launch run together (one warp each), with its inline PTX
replaced by models: cp.async copies that land one to three scheduler rounds after they are
issued, in random order, zero-filling past their source bytes (a stage read before its bytes
land, or refilled while it is read, gives wrong sums), their commit groups and waits, and
tc.cuh's tensor-core pieces (tc_models.h). The down items spin on their
expert's counter until every gate+up item of it is done (a wait that yields). Ragged tables
(jobs of no rows, hidden and output rows not multiples of the 16- and 32-row items, K ending
inside a stage and inside a 1024-element block, one x shared by all jobs as a routed token's
experts have, an x not 16-byte aligned), rings of 2 to 6 stages of 2 and 4 steps, fewer
blocks than items, 1 to 4 activation rows per job, fmt 2 and fmt 4 (group sizes 32 to 256),
against float64: every output
written, nothing past the outputs touched, within 1e-5. The GPU tests of the same kernel:
``test_moe_wq.py``."""

from __future__ import annotations

import shutil

import pytest
from _emulate import build_and_run, without_ptx

from coliworker.kernels import sources

_ASM = ("tc_bf16", "tc_nib2", "tc_quad", "tc_mma", "tc_mma_q8", "wq_cp16", "wq_commit",
        "wq_wait")  # fmt: skip

_SHIM = r"""
#include "fibers.h"
#include <map>
#include "tc_models.h"
// cp.async: each copy lands 1 to 3 rounds after it is issued (random order), n bytes read and
// the rest of the 16 zeroed; a thread's groups are numbered by its commits (empty ones too).
struct Cp { void *dst; const void *src; int n; Fiber *f; long group, round; };
std::vector<Cp> g_cps;
std::map<Fiber *, long> g_group;
long g_round;
std::mt19937 g_lag(11);
inline void wq_cp16(void *dst, const void *src, int n) {
    if ((size_t)dst % 16 || (n && (size_t)src % 16) || n < 0 || n > 16) {
        std::printf("cp.async: misaligned or bad size (%d)\n", n);
        std::exit(4);
    }
    g_cps.push_back({dst, src, n, cur, g_group[cur], g_round + 1 + (long)(g_lag() % 3)});
}
inline void wq_commit() { ++g_group[cur]; }
template <int N> inline void wq_wait() {  // every group but the N last committed has landed
    for (;;) {
        bool left = false;
        for (const Cp &c : g_cps) left |= c.f == cur && c.group < g_group[cur] - N;
        if (!left) return;
        yield_();
    }
}
bool land() {
    ++g_round;
    bool any = false;
    std::shuffle(g_cps.begin(), g_cps.end(), g_lag);
    for (size_t i = 0; i < g_cps.size();) {
        Cp &c = g_cps[i];
        if (c.round > g_round) { ++i; continue; }
        std::memset(c.dst, 0, 16);
        if (c.n) std::memcpy(c.dst, c.src, c.n);
        g_cps[i] = g_cps.back(); g_cps.pop_back();
        any = true;
    }
    return any;
}
#define __nanosleep(x) yield_()
#include "kernel.inc"

inline int padded(int k) { return (k + 1023) / 1024 * 1024; }

// nj experts of hidden size ie and width d, rows[j] (0 to R) activation rows each; one x for
// all (same_x) or one each, xoff floats past its 16-byte aligned start. moe_wq<FMT, R, S, D>
// on `grid` blocks; fmt 4: groups of gs.
template <int FMT, int R, int S, int D>
int check(int d, int ie, std::vector<int> rows, bool same_x, int grid, int xoff = 0,
          int gs = 0) {
    std::mt19937 rng(d * 7 + ie + grid + S * 10 + D + R * 100);
    std::normal_distribution<float> nd;
    const int nj = (int)rows.size(), pa = padded(d), pb = padded(ie), pad = 5;
    const int lda = pa / 2, ldb = pb / 2;
    const int nga = FMT == 4 ? pa / gs : 1, ngb = FMT == 4 ? pb / gs : 1;
    const int shift = FMT == 4 ? __builtin_ctz(gs) : 2;
    struct E { std::vector<unsigned char> wg, wu, wd; std::vector<float> sg, su, sd, x, h, y; };
    std::vector<E> ex(nj);
    auto bytes = [&](std::vector<unsigned char> &v, size_t n) {
        v.resize(n + 16); for (auto &b : v) b = rng() & 255; };
    auto scales = [&](std::vector<float> &v, size_t n) {
        v.resize(n); for (auto &s : v) s = 0.001f + 0.01f * std::fabs(nd(rng)); };
    std::vector<MoeJob> jobs(nj);
    for (int j = 0; j < nj; ++j) {
        E &e = ex[j];
        bytes(e.wg, (size_t)ie * lda); bytes(e.wu, (size_t)ie * lda); bytes(e.wd, (size_t)d * ldb);
        scales(e.sg, (size_t)ie * nga); scales(e.su, (size_t)ie * nga);
        scales(e.sd, (size_t)d * ngb);
        e.x.resize((size_t)R * d + 4);
        for (auto &v : e.x) v = nd(rng);
        e.h.assign((size_t)rows[j] * ie + pad, NAN);
        e.y.assign((size_t)rows[j] * d + pad, NAN);
        auto at = [](const auto &v) { return (unsigned long long)v.data(); };
        jobs[j] = {at(e.wg), at(e.sg), at(e.wu), at(e.su), at(e.wd), at(e.sd),
                   at(same_x ? ex[0].x : e.x) + 4 * xoff, at(e.h), at(e.y), rows[j], ie, d, 0};
    }
    for (auto &e : ex)  // 16-byte aligned activations, as the arena's
        if ((size_t)e.x.data() % 16) { std::printf("x not aligned\n"); return 1; }
    const int ta = (ie + 15) / 16, tb = (d + 31) / 32;
    std::vector<int> ctr(1 + nj, 0);
    g_tick = land;
    constexpr int SMEM = MoeWq<FMT, R, S, D>::SMEM;
    const int gsa = FMT == 4 ? gs : 4;
    launch({grid, 1, 1}, grid, 32, [&] {
        moe_wq<FMT, R, S, D>(jobs.data(), ctr.data(), nj, ta, tb, d, pa, lda, nga, gsa, shift,
                             ie, pb, ldb, ngb, gsa, shift); }, 0, SMEM / 16 + 1);
    g_tick = nullptr;
    if (!g_cps.empty()) { std::printf("copies never landed\n"); return 1; }
    double md = 0, mx = 0;
    long unwritten = 0, touched = 0;
    for (int j = 0; j < nj; ++j) {
        const E &e = ex[j];
        const float *x0 = (same_x ? ex[0].x.data() : e.x.data()) + xoff;
        for (size_t o = (size_t)rows[j] * ie; o < e.h.size(); ++o) touched += !std::isnan(e.h[o]);
        for (size_t o = (size_t)rows[j] * d; o < e.y.size(); ++o) touched += !std::isnan(e.y[o]);
        for (int s = 0; s < rows[j]; ++s) {
            const float *x = x0 + (size_t)s * d;
            std::vector<double> h(ie);
            for (int r = 0; r < ie; ++r) {
                double g = 0, u = 0;
                for (int k = 0; k < d; ++k) {
                    const size_t si = FMT == 4 ? (size_t)r * nga + k / gs : r;
                    g += (double)code(&e.wg[(size_t)r * lda], k) * x[k] *
                         (FMT == 4 ? e.sg[si] : 1.f);
                    u += (double)code(&e.wu[(size_t)r * lda], k) * x[k] *
                         (FMT == 4 ? e.su[si] : 1.f);
                }
                if (FMT == 2) { g *= e.sg[r]; u *= e.su[r]; }
                h[r] = g / (1 + std::exp(-g)) * u;
            }
            for (int o = 0; o < d; ++o) {
                double v = 0;
                for (int k = 0; k < ie; ++k)
                    v += (double)code(&e.wd[(size_t)o * ldb], k) * h[k] *
                         (FMT == 4 ? e.sd[(size_t)o * ngb + k / gs] : 1.f);
                if (FMT == 2) v *= e.sd[o];
                const float got = e.y[(size_t)s * d + o];
                if (std::isnan(got)) { ++unwritten; continue; }
                md = std::max(md, std::fabs(got - v)); mx = std::max(mx, std::fabs(v));
            }
        }
    }
    std::printf("moe_wq<%d, %d, %d, %d> gs %d d %d ie %d jobs %d same_x %d grid %d x at +%d: "
                "rel err %.2g, unwritten %ld, touched %ld\n", FMT, R, S, D, gs, d, ie, nj,
                (int)same_x, grid, xoff, md / mx, unwritten, touched);
    return unwritten > 0 || touched > 0 || !(md <= 1e-5 * mx);
}

int main() {
    return check<2, 1, 2, 4>(1100, 40, {1, 1, 0}, false, 5) +   // K 76 past a block; idle job
           check<2, 1, 4, 3>(2048 + 24, 36, {1, 1}, true, 3) +   // one x, a 17th item of 16 rows
           check<2, 1, 2, 2>(700, 70, {1, 0, 1, 1}, false, 7) +  // a ring of 2: one stage ahead
           check<2, 1, 4, 4>(1024, 16, {1}, true, 2) +           // one gate+up item, 32 down
           check<2, 1, 2, 6>(3000, 52, {1, 1}, true, 9) +
           check<2, 1, 2, 4>(1100, 40, {1, 1}, false, 4, 1) +    // x 4 bytes past 16: not copied
           // fmt 4: stages of S steps inside one group per quad (gs >= 16 S), 1024 / gs scales
           // per row and block
           check<4, 1, 2, 4>(1100, 40, {1, 1, 0}, false, 5, 0, 32) +
           check<4, 1, 4, 3>(2048 + 24, 36, {1, 1}, true, 3, 0, 64) +
           check<4, 1, 4, 2>(2100, 44, {1, 1}, false, 4, 0, 128) +
           check<4, 1, 2, 6>(1500, 52, {1, 1}, true, 6, 1, 256) +
           check<4, 1, 4, 4>(1024, 16, {1}, true, 2, 0, 64) +
           // up to 4 rows per job (two n-tiles of 12 columns), jobs of 0 to 4 rows
           check<2, 4, 2, 4>(1100, 40, {4, 1, 0, 3}, false, 5) +
           check<2, 4, 4, 3>(2048 + 24, 36, {2, 4}, false, 3, 1) +
           check<4, 4, 4, 3>(2100, 44, {4, 3}, false, 4, 0, 64) +
           check<4, 4, 2, 4>(1100, 52, {1, 4, 2}, false, 6, 0, 32);
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_moe_wq_on_cpu(tmp_path, host_module):
    # Also: the host's shared-memory size of every compiled form is the kernel's MoeWq::SMEM.
    mm = host_module("matmul")
    forms = [tuple(int(v) for v in n[n.index("<") + 1 : -1].split(",")) for n in mm.WQ_VARIANTS]
    smem = "".join(
        f"    if (MoeWq<{f}, {r}, {s}, {d}>::SMEM != {mm.wq_smem(f, r, s, d)}) "
        f'{{ std::printf("SMEM of <{f}, {r}, {s}, {d}>\\n"); return 1; }}\n'
        for f, r, s, d in forms
    )
    shim = _SHIM.replace("int main() {\n", "int main() {\n" + smem, 1)
    assert smem and shim != _SHIM
    build_and_run(tmp_path, shim, without_ptx(sources.source("moe_wq.cu"), _ASM), 600)


@pytest.mark.parametrize(
    "fmt,gs,d,ie,rows,served",
    [
        (2, 0, 6144, 2048, 1, True),
        (2, 0, 6144, 2048, 4, True),
        (2, 0, 6144, 2048, 5, False),  # more rows than R = 4
        (4, 32, 6144, 2048, 1, True),
        (4, 256, 6144, 2048, 3, True),
        (4, 16, 6144, 2048, 1, False),  # a stage of 2 steps spans two groups
        (4, 48, 6144, 2048, 1, False),  # not a power of two
        (4, 512, 6144, 2048, 1, False),  # under one 16-byte copy of scales per block
        (2, 0, 6146, 2048, 1, False),  # x rows not 16-byte aligned
        (2, 0, 6144, 2050, 1, False),  # h rows not 16-byte aligned
        (1, 0, 6144, 2048, 1, False),  # int8
    ],
)
def test_where_moe_wq_serves(host_module, fmt, gs, d, ie, rows, served):
    mm = host_module("matmul")
    gu, dn = mm.WeightSpec.of(fmt, d, gs), mm.WeightSpec.of(fmt, ie, gs)
    assert mm.wq_eligible(gu, dn, rows) == served


@pytest.mark.parametrize(
    "setting,fmt,gs,rows,expect",
    [
        ("auto", 4, 64, 1, "auto"),  # grouped scales at one row: where it measured faster
        ("auto", 4, 32, 1, "auto"),  # (wq_form then keeps S <= gs / 16)
        ("auto", 4, 64, 2, None),  # more rows: moe_tc_f
        ("auto", 2, 0, 1, None),  # plain int4: moe_tc_f
        ("auto", 4, 48, 1, None),  # not served at all
        (True, 2, 0, 4, "sd"),
        (True, 4, 64, 1, "sd"),
        (True, 2, 0, 5, None),
        (False, 4, 64, 1, None),
    ],
)
def test_moe_wq_choice(host_module, monkeypatch, setting, fmt, gs, rows, expect):
    # MOE_WQ "auto" (the default) asks for WQ_AUTO_SD on fmt 4 groups of one row per expert
    # only; on, WQ_SD wherever moe_wq serves; off, never. moe_launch takes moe_wq exactly where
    # wq_choice names a form.
    mm = host_module("matmul")
    monkeypatch.setattr(mm, "MOE_WQ", setting)
    monkeypatch.setattr(mm, "WQ_SD", (2, 6))
    gu, dn = mm.WeightSpec.of(fmt, 6144, gs), mm.WeightSpec.of(fmt, 2048, gs)
    want = {"auto": mm.WQ_AUTO_SD, "sd": (2, 6), None: None}[expect]
    assert mm.wq_choice(gu, dn, rows) == want
    if want is not None:
        s, d = mm.wq_form(fmt, gs, 1 if rows == 1 else 4, want)
        assert f"moe_wq<{fmt}, {1 if rows == 1 else 4}, {s}, {d}>" in mm.WQ_VARIANTS


@pytest.mark.parametrize("sd", [(2, 4), (2, 6), (4, 3), (4, 4)])
@pytest.mark.parametrize("fmt,gs,r", [(2, 0, 1), (2, 0, 4), (4, 32, 1), (4, 64, 1), (4, 64, 4)])
def test_moe_wq_forms(host_module, sd, fmt, gs, r):
    # Every form a launch can ask for is compiled (WQ_VARIANTS), fmt 4's stages lie inside one
    # group (16 S <= gs) and R = 4 at fmt 4 keeps S = 2; one block fits an SM's shared memory
    # (the kernel's own size: test_moe_wq_on_cpu).
    mm = host_module("matmul")
    s, d = mm.wq_form(fmt, gs, r, sd)
    assert f"moe_wq<{fmt}, {r}, {s}, {d}>" in mm.WQ_VARIANTS
    assert d == sd[1] and s <= sd[0]
    if fmt == 4:
        assert 16 * s <= gs and (r == 1 or s == 2)
    assert mm.wq_smem(fmt, r, s, d) + 1024 <= 227 * 1024
