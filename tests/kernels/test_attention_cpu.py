"""attention.cu's kernels on the CPU, no GPU needed (CI runs them): a model of
``mla_absorb_w``'s lane/column map over the resident layout, and the CUDA source of the
absorb kernels (g++ through a stand-in for the built-ins they use) and of the flash and
merge kernels (one fiber per CUDA thread, the inline PTX emulated) against each other and
the float64 reference; and the host's choice of flash clusters. The GPU tests of the same
kernels: ``test_attention.py``."""

from __future__ import annotations

import functools
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
from _emulate import build_and_run, without_ptx
from _kern import make_tensor

from coliworker.kernels import layout, sources


def test_absorb_w_map(rng):
    """The columns mla_absorb_w gives each lane (col0 + 128 j + k of column group g) and its
    decode of a 16-byte chunk (abw_decode: quad qq of word qq / 2, nibble k) read the resident
    layout as load_elem does (layout.decode_resident), every format it serves; CPU model."""
    for fmt, k_in, gs in ((2, 40, 0), (2, 512, 0), (2, 1100, 0), (4, 1100, 8), (4, 512, 12)):
        t = make_tensor(rng, fmt, 3, k_in, gs)
        lay = layout.Layout.of(fmt, k_in, t.group_size)
        dev = layout.relayout(np, t, t.weights)
        sc = layout.scales(np, t, t.scales)
        want = layout.decode_resident(t, dev, sc)
        rows = dev.reshape(3, lay.ld)
        blk = lay.block_elems
        got = np.full_like(want, np.nan)
        for g in range(-(-k_in // 512)):
            b, q0 = g * 512 // blk, (g * 512 - (g * 512 // blk) * blk) >> 7
            for lane in range(32):
                chunk = rows[:, b * 512 + lane * 16 : b * 512 + lane * 16 + 16]
                words = chunk.copy().view("<u4")  # [3, 4]
                col0 = b * blk + q0 * 128 + 4 * lane
                for j in range(4):
                    qq = q0 + j
                    x = words[:, qq // 2] >> np.uint32(16 * (qq % 2))
                    for kk in range(4):
                        c = col0 + 128 * j + kk
                        if c >= k_in:
                            continue
                        v = ((x >> np.uint32(4 * kk)) & 15).astype(np.float64) - 8
                        if fmt == 4:
                            s = sc.reshape(3, lay.ngp)[:, (col0 + 128 * j) // t.group_size]
                        else:
                            s = sc
                        got[:, c] = v * s
        assert np.array_equal(got, want), (fmt, k_in, gs)


# A CPU stand-in for the CUDA built-ins mla_absorb and mla_absorb_w use (one block at a time,
# one std::thread per CUDA thread, std::barrier for __syncthreads): the absorb kernels have no
# warp-level or asm instructions, so g++ runs their source as it is.
_SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct dim3 { int x, y, z; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
thread_local dim3 threadIdx;
dim3 blockIdx, gridDim, blockDim;
std::barrier<> *g_bar;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
template <class T> inline T __ldg(const T *p) { return *p; }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
using std::max; using std::min;
alignas(16) float4 SMEM[60000];
#include "common.cuh"
#include "absorb.inc"
template <class F> void launch(dim3 g, int nt, F f) {
    gridDim = g; blockDim = {nt, 1, 1};
    for (int z = 0; z < g.z; ++z) for (int y = 0; y < g.y; ++y) for (int x = 0; x < g.x; ++x) {
        blockIdx = {x, y, z};
        std::barrier<> bar(nt); g_bar = &bar;
        std::vector<std::thread> ts;
        for (int t = 0; t < nt; ++t) ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; f(); });
        for (auto &t : ts) t.join();
    }
}
template <int F, int SB> int check(int S, int H, int Q, int R, int V, int K, int gsz) {
    std::mt19937 rng(S * 7 + K);
    const int inp = (K + 1023) / 1024 * 1024, ld = inp / 2, O = H * (Q + V);
    const int ngp = F == 4 ? (inp + gsz - 1) / gsz : 1, gs = F == 4 ? gsz : 4;
    const int shift = (gs & (gs - 1)) == 0 ? __builtin_ctz(gs) : -1;
    std::vector<unsigned char> w((size_t)O * ld);
    for (auto &b : w) b = rng() & 255;
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> sc((size_t)O * ngp), q((size_t)S * H * (Q + R));
    for (auto &x : sc) x = 0.001f + 0.01f * (u(rng) + 1);
    for (auto &x : q) x = u(rng);
    std::vector<float> a((size_t)S * H * (K + R), NAN), b = a;
    launch({H, (K + 511) / 512, (S + SB - 1) / SB}, 256, [&] {
        mla_absorb_w<F, SB, false>(a.data(), nullptr, nullptr, q.data(), w.data(), sc.data(),
                                   nullptr, nullptr, nullptr, 0, S, H, Q, R, V, K, ld, ngp, gs,
                                   shift); });
    launch({H, (K + 127) / 128, (S + 7) / 8}, 512, [&] {
        mla_absorb<F>(b.data(), nullptr, nullptr, q.data(), w.data(), sc.data(), nullptr, nullptr,
                      nullptr, 0, S, H, Q, R, V, K, ld, ngp, gs, shift); });
    double d = 0, m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i]) || std::isnan(b[i])) return 1;  // an output left unwritten
        d = std::max(d, (double)std::fabs(a[i] - b[i]));
        m = std::max(m, (double)std::fabs(b[i]));
    }
    printf("fmt %d SB %d S %d K %d: %.2g\n", F, SB, S, K, d / m);
    return d > 1e-6 * m;
}
int main() {
    return check<2, 1>(1, 2, 192, 64, 256, 512, 0) + check<2, 8>(10, 2, 16, 8, 12, 40, 0)
         + check<2, 4>(3, 2, 24, 8, 16, 1100, 0) + check<4, 8>(9, 2, 40, 4, 8, 512, 8)
         + check<4, 4>(4, 2, 20, 4, 8, 1100, 12);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_absorb_w_on_cpu(tmp_path):
    """mla_absorb_w against mla_absorb (the kernel the GPU tests check against float64), their
    CUDA source run on the CPU through a stand-in for the built-ins they use: every output
    written, equal to fp32 rounding, at 1 to 10 tokens (SB 1, 4, 8; two z blocks), K 40 to
    1100 (several column groups, quads 4..7, a second 512-byte block), fmt 2 and fmt 4 (gs 8,
    12)."""
    kdir = Path(__file__).resolve().parents[2] / "kernels"
    src = sources.source("attention.cu")
    part = src[src.index("struct KvDesc") : src.index("#define ATT_WARPS")]
    part = part.replace("extern __shared__ float4 abw_sm4[];", "float4 *abw_sm4 = SMEM;")
    part = part.replace("extern __shared__ float qs[];", "float *qs = (float *)SMEM;")
    (tmp_path / "absorb.inc").write_text(part)
    (tmp_path / "emu.cpp").write_text(_SHIM)
    exe = tmp_path / "emu"
    cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{kdir}", "-o", str(exe)]
    cc = subprocess.run([*cmd, str(tmp_path / "emu.cpp")], capture_output=True, text=True)
    if cc.returncode != 0 and "barrier" in cc.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert cc.returncode == 0, cc.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


# attention.cu's kernels on the CPU: one fiber (ucontext) per CUDA thread, run in turn until
# each reaches a barrier (__syncthreads, a warp's, the cluster's: fibers.h); the inline-PTX
# helpers are replaced: mma.m16n8k8 tf32 by the fragment layout of the PTX manual (operands cut
# to tf32, the sum in float64), a warp shuffle by an exchange at a warp barrier (fibers.h),
# cp.async by a copy (zero fill for n = 0), DSMEM reads by the same offset in the rank's block;
# then the kernels (``_cpu_source``) as kernel.inc. A test's checks follow.
_FIBER_SHIM = r"""
#include "fibers.h"
inline double tf32(unsigned u) { return (double)__uint_as_float(u & 0xffffe000u); }
inline void fl_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                   unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    Warp *w = tl_warp;
    unsigned *u = w->u[lane];
    u[0] = a0; u[1] = a1; u[2] = a2; u[3] = a3; u[4] = b0; u[5] = b1;
    w->bar->arrive_and_wait();
    auto A = [&](int r, int k) {
        return tf32(w->u[(r & 7) * 4 + (k & 3)][(r >> 3) + 2 * (k >> 2)]);
    };
    auto B = [&](int k, int n) { return tf32(w->u[n * 4 + (k & 3)][4 + (k >> 2)]); };
    float o[4];
    for (int e = 0; e < 4; ++e) {
        const int r = gid + 8 * (e >> 1), c = 2 * t + (e & 1);
        double acc = 0;
        for (int k = 0; k < 8; ++k) acc += A(r, k) * B(k, c);
        o[e] = (float)(acc + d[e]);
    }
    w->bar->arrive_and_wait();
    for (int e = 0; e < 4; ++e) d[e] = o[e];
}
inline void fl_cpn(float *dst, const float *src, int n, int b) {
    if (n) std::memcpy(dst, src, b);
    else std::memset(dst, 0, b);
}
inline void fl_cp4(float *dst, const float *src, int n) { fl_cpn(dst, src, n, 4); }
inline void fl_cp16(float *dst, const float *src, int n) { fl_cpn(dst, src, n, 16); }
#include "cluster_models.h"
// fp16 (binary16) by round to nearest even, subnormals and overflow included, and back.
inline unsigned short f2h(float f) {
    const unsigned short sign = (__float_as_uint(f) >> 16) & 0x8000;
    const float a = std::fabs(f);
    if (std::isnan(f)) return sign | 0x7e00;
    if (a >= 65520.f) return sign | 0x7c00;
    if (a < 6.103515625e-05f) return sign | (unsigned short)std::nearbyint(a * 16777216.f);
    int ex;
    std::frexp(a, &ex);
    float q = std::nearbyint(std::ldexp(a, 11 - ex));
    if (q == 2048.f) { q = 1024.f; ++ex; }
    if (ex + 14 >= 31) return sign | 0x7c00;
    return sign | (unsigned short)((ex + 14) << 10) | (unsigned short)((unsigned)q - 1024);
}
inline double h2d(unsigned short h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? std::ldexp((double)m, -24)
                   : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((double)(m + 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}
inline void fh_split2(float a, float b, unsigned &hi, unsigned &lo) {
    const unsigned short ha = f2h(a), hb = f2h(b);
    hi = ha | (unsigned)hb << 16;
    lo = f2h(a - (float)h2d(ha)) | (unsigned)f2h(b - (float)h2d(hb)) << 16;
}
inline double hpart(unsigned u, int k) { return h2d((unsigned short)(u >> (16 * (k & 1)))); }
// mma.m16n8k16 f16: the fragment layout of the PTX manual, the sum in float64.
inline void fh_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    Warp *w = tl_warp;
    unsigned *u = w->u[lane];
    u[0] = a[0]; u[1] = a[1]; u[2] = a[2]; u[3] = a[3]; u[4] = b0; u[5] = b1;
    w->bar->arrive_and_wait();
    auto A = [&](int r, int k) {
        return hpart(w->u[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k);
    };
    auto B = [&](int k, int n) { return hpart(w->u[n * 4 + ((k & 7) >> 1)][4 + (k >> 3)], k); };
    float o[4];
    for (int e = 0; e < 4; ++e) {
        const int r = gid + 8 * (e >> 1), c = 2 * t + (e & 1);
        double acc = 0;
        for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, c);
        o[e] = (float)(acc + d[e]);
    }
    w->bar->arrive_and_wait();
    for (int e = 0; e < 4; ++e) d[e] = o[e];
}
// ldmatrix .x4 / .x2 (.trans): every lane leaves its row address, then reads its pairs.
template <int N, bool T>
inline void fh_ldsm(unsigned (&r)[4], const unsigned short *p) {
    const int lane = threadIdx.x & 31;
    Warp *w = tl_warp;
    std::memcpy(w->u[lane], &p, sizeof p);
    w->bar->arrive_and_wait();
    auto row = [&](int l) {
        const unsigned short *q;
        std::memcpy(&q, w->u[l], sizeof q);
        return q;
    };
    for (int i = 0; i < N; ++i) {
        if (T) r[i] = row(8 * i + 2 * (lane & 3))[lane >> 2]
                    | (unsigned)row(8 * i + 2 * (lane & 3) + 1)[lane >> 2] << 16;
        else { std::memcpy(&r[i], row(8 * i + (lane >> 2)) + 2 * (lane & 3), 4); }
    }
    w->bar->arrive_and_wait();
}
inline void fh_ldsm4(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<4, false>(r, p); }
inline void fh_ldsm4t(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<4, true>(r, p); }
inline void fh_ldsm2t(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<2, true>(r, p); }
#include "common.cuh"
#include "kernel.inc"
"""

# mla_flash, mla_flash_c, mla_flash_h, mla_flash_hc and mla_merge against float64.
_FLASH_SHIM = (
    _FIBER_SHIM
    + r"""
int run(int H, std::vector<int> lens, int nsplit, int C, bool f16 = false, int K = 512,
        int R = 64, float lat_scale = 3, int spread = 0) {
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
    } else if (C == 1) launch({nsplit, S, nhb}, 1, 256, args(mla_flash<32>));
    else if (C == 2) launch({nsplit, S, nhb}, 2, 256, args(mla_flash_c<32, 2>));
    else if (C == 4) launch({nsplit, S, nhb}, 4, 256, args(mla_flash_c<32, 4>));
    else launch({nsplit, S, nhb}, 8, 256, args(mla_flash_c<32, 8>));
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
    printf("%s H %d S %d K %d nsplit %d C %d: rel err %.2g, unwritten %ld\n",
           f16 ? "fp16" : "tf32", H, S, K, nsplit, C, md / mx, nan);
    return nan > 0 || md > 1e-5 * mx;
}

int main() {
    // clusters into cl (an empty sequence beside), partials + mla_merge over two head blocks
    // (heads beyond H), C = 4 and C = 8 (slices without rows)
    // (every merge by mla_merge<1> and mla_merge<4>)
    // mla_flash_h (fp16 parts): the same, K = 11 and 12 (one n-tile a half; odd widths: scalar
    // loads), latents 1e4, 1e-6 and 1e-8 times the rope (each segment's scale; K = 40: the rope
    // staged from column 48), rows 2^-12 .. 2^12 apart in one tile (P's scale per row)
    return run(64, {40, 1}, 2, 2) + run(70, {70}, 4, 2) + run(64, {50}, 4, 4) +
           run(64, {33, 1}, 8, 8) + run(64, {40, 1}, 2, 2, true) + run(70, {70, 17}, 4, 1, true) +
           run(64, {33, 1}, 8, 8, true) + run(5, {20, 3}, 2, 1, true, 12, 4) +
           run(3, {37}, 2, 1, true, 11, 3) + run(64, {90}, 2, 1, true, 512, 64, 1e4f) +
           run(64, {90}, 2, 1, true, 512, 64, 1e-6f) + run(64, {90}, 2, 1, true, 512, 64, 1e-8f) +
           run(64, {70}, 2, 1, true, 512, 64, 3, 12) + run(4, {40}, 2, 1, true, 40, 8, 1e-8f) +
           run(70, {300, 5}, 20, 1, true);  // 20 splits: mla_merge<4>'s warps, 5 splits each
}
"""
)
_FL_ASM = (
    "fl_mma", "fl_cp4", "fl_cp16", "coli_cluster_rank", "coli_cluster_sync",
    "coli_cluster_wait_exit", "coli_remote", "coli_dsmem_load", "coli_dsmem_load4", "fh_split2",
    "fh_mma", "fh_ldsm4", "fh_ldsm4t", "fh_ldsm2t",
)  # fmt: skip


def _cpu_source(src: str) -> str:
    """attention.cu's kernels (attention_flash.cuh and attention_flash_h.cuh inlined, as
    compiled; common.cuh left to the shim) without their inline PTX, their shared memory the
    fiber's block memory."""
    part = without_ptx(src[src.index("struct KvDesc") :], _FL_ASM)
    for old, new in (
        ("extern __shared__ float wz[];", "float *wz = (float *)cur_smem();"),
        ("extern __shared__ float qs[];", "float *qs = (float *)cur_smem();"),
        ("extern __shared__ float4 abw_sm4[];", "float4 *abw_sm4 = cur_smem();"),
        (
            "__shared__ float red[2][4];",
            "float (&red)[2][4] = *(float (*)[2][4])((float *)cur_smem() + 60000);",
        ),
    ):
        assert old in part, old
        part = part.replace(old, new)
    return part


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_flash_clusters_on_cpu(tmp_path):
    """mla_flash_c (C = 2, 4, 8: into cl, and into partials for mla_merge; two head blocks,
    heads beyond H, slices without rows) against float64 at GLM-5.2 widths (K 512, R 64), their
    CUDA source run on the CPU (``_FLASH_SHIM``): every output written, within 1e-5 (~1e-6)."""
    build_and_run(tmp_path, _FLASH_SHIM, _cpu_source(sources.source("attention.cu")), 240)


# mla_absorb_w<F, SB, true> (the q rows split by the absorb) against mla_absorb_w<F, SB, false>
# then mla_qsplit, on the same inputs; one new cache row per token scattered by both.
_QSPLIT_SHIM = (
    _FIBER_SHIM
    + r"""
template <class T> unsigned long long fnv(const std::vector<T> &v) {
    unsigned long long h = 1469598103934665603ull;
    const unsigned char *p = reinterpret_cast<const unsigned char *>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}
template <class T> bool same(const std::vector<T> &a, const std::vector<T> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
// What one way makes: qfull (NaN where unwritten), qs, qe (fill where unwritten), the caches.
struct Out {
    std::vector<float> qfull, lat, rope;
    std::vector<unsigned short> qs;
    std::vector<int> qe;
};
template <int F, int SB> int check(int S, int H, int Q, int R, int V, int K, int gsz) {
    std::mt19937 rng(S * 7 + K + R);
    const int inp = (K + 1023) / 1024 * 1024, ld = inp / 2, O = H * (Q + V);
    const int ngp = F == 4 ? (inp + gsz - 1) / gsz : 1, gs = F == 4 ? gsz : 4;
    const int shift = (gs & (gs - 1)) == 0 ? __builtin_ctz(gs) : -1;
    const int KRP = (K + 15) / 16 * 16 + (R + 15) / 16 * 16, rows = S * H;
    std::vector<unsigned char> w((size_t)O * ld);
    for (auto &b : w) b = rng() & 255;
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> sc((size_t)O * ngp), q((size_t)rows * (Q + R));
    std::vector<float> nlat((size_t)S * K), nrope((size_t)S * R);
    for (auto &x : sc) x = 0.001f + 0.01f * (u(rng) + 1);
    for (size_t i = 0; i < q.size(); ++i) {  // ropes 2^-12 .. 2^12: exponents not the latent's
        const int row = (int)(i / (Q + R)), d = (int)(i % (Q + R));
        q[i] = u(rng) * (d < Q ? 1.f : std::ldexp(1.f, row % 25 - 12));
    }
    for (int d = 0; d < Q + R; ++d) q[(size_t)(rows - 1) * (Q + R) + d] = 0.f;  // a zero row
    for (auto &x : nlat) x = u(rng);
    for (auto &x : nrope) x = u(rng);
    auto way = [&](bool fused, unsigned short fill) {
        Out o{std::vector<float>((size_t)rows * (K + R), NAN), std::vector<float>((size_t)S * K),
              std::vector<float>((size_t)S * R),
              std::vector<unsigned short>((size_t)rows * 2 * KRP, fill),
              std::vector<int>((size_t)rows * 2, -(int)fill)};
        std::vector<KvDesc> kv(S);
        for (int s = 0; s < S; ++s)
            kv[s] = {(unsigned long long)(o.lat.data() + (size_t)s * K),
                     (unsigned long long)(o.rope.data() + (size_t)s * R), 1, s};
        const dim3 g{H, (K + 511) / 512, (S + SB - 1) / SB};
        if (fused)
            launch(g, 1, 256, [&] {
                mla_absorb_w<F, SB, true>(o.qfull.data(), o.qs.data(), o.qe.data(), q.data(),
                                          w.data(), sc.data(), kv.data(), nlat.data(),
                                          nrope.data(), S, S, H, Q, R, V, K, ld, ngp, gs, shift);
            });
        else {
            launch(g, 1, 256, [&] {
                mla_absorb_w<F, SB, false>(o.qfull.data(), nullptr, nullptr, q.data(), w.data(),
                                           sc.data(), kv.data(), nlat.data(), nrope.data(), S, S,
                                           H, Q, R, V, K, ld, ngp, gs, shift);
            });
            launch({(rows + 7) / 8, 1, 1}, 1, 256,
                   [&] { mla_qsplit(o.qs.data(), o.qe.data(), o.qfull.data(), rows, K, R, KRP); });
        }
        return o;
    };
    const Out a = way(false, 0x5555), b = way(true, 0xAAAA);
    long nan = 0, nz = 0;
    for (float x : a.qfull) nan += std::isnan(x);
    for (unsigned short x : a.qs) nz += x != 0;
    const bool ok = same(a.qfull, b.qfull) && same(a.qs, b.qs) && same(a.qe, b.qe) &&
                    same(a.lat, b.lat) && same(a.rope, b.rope) && nan == 0;
    printf("fmt %d SB %d S %d H %d K %d R %d: %s; qsplit / fused qfull %016llx / %016llx, qs "
           "%016llx / %016llx, qe %016llx / %016llx (%ld nonzero halves, NaN %ld)\n",
           F, SB, S, H, K, R, ok ? "the same bytes" : "DIFFERENT", fnv(a.qfull), fnv(b.qfull),
           fnv(a.qs), fnv(b.qs), fnv(a.qe), fnv(b.qe), nz, nan);
    return !ok;
}

int main() {
    // GLM-5.2 widths at 1 and 3 tokens (SB 1, 4); K 40 / R 24 over two z blocks (fmt 4, gs 8);
    // K 37 / R 6 (scalar loads; fmt 2) and K 500 / R 64 (fmt 4, gs 12)
    return check<2, 1>(1, 64, 192, 64, 256, 512, 0) + check<2, 4>(3, 64, 192, 64, 256, 512, 0) +
           check<4, 8>(10, 4, 24, 24, 16, 40, 8) + check<2, 8>(9, 3, 20, 6, 8, 37, 0) +
           check<4, 4>(5, 2, 16, 64, 12, 500, 12);
}
"""
)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_absorb_w_qsplit_on_cpu(tmp_path):
    """mla_absorb_w<F, SB, true> (the q rows split for mla_flash_h by the absorb, no mla_qsplit
    launch) against mla_absorb_w<F, SB, false> then mla_qsplit on the same inputs, their CUDA
    source run on the CPU (``_QSPLIT_SHIM``): qs, qe, qfull and the scattered cache rows are
    the same bytes, every qfull value written; GLM-5.2 widths at 1 and 3 tokens, K 40 / R 24
    over two z blocks, K 37 / R 6 (scalar loads), K 500, fmt 2 and fmt 4, ropes 2^-12 .. 2^12
    against the latent, a zero row."""
    build_and_run(tmp_path, _QSPLIT_SHIM, _cpu_source(sources.source("attention.cu")), 240)


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
    assert att._krp16(512, 64) == 576 and att._krp16(40, 8) == 64 and att._krp16(11, 3) == 32
    for k, r in ((512, 64), (40, 8), (11, 3), (256, 32), (500, 100)):
        geo = att._flash_geometry(k, r, True)
        assert geo is not None, (k, r)
        ntc, qst, kst, smem = geo
        krp = att._krp16(k, r)
        assert 16 * ntc >= k and (ntc == 1 or 8 * ntc < k)
        assert qst == krp + 8 and kst == max(krp, 16 * ntc) + 8
        assert qst % 16 == 8 and kst % 16 == 8  # 4 mod 8 words a row, rows 16-byte aligned
        want = 4 * (64 * qst + 16 * kst) + 4 * 2 * 64 * 16 + 8 * (64 + 16)
        assert smem == want <= att.FL_SMEM_MAX
    assert att._flash_geometry(512, 64, True)[3] == 195712
    assert att._flash_geometry(512, 144, True) is None  # 512 + 144 > FH_MAX_W = 640
    assert att._flash_geometry(512, 128, True) is not None
    assert att._flash_geometry(520, 64, True) is None  # K > 512: no NTC
    for f16 in (False, True):  # every variant the host names is compiled
        for ntc in (1, 2, 4, 8, 16, 32):
            assert att._flash_name(f16, ntc, 1) in att.VARIANTS
        for ntc, cs in att.FL_CLUSTERS.items():
            assert all(att._flash_name(f16, ntc, c) in att.VARIANTS for c in cs)


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
