"""attention.cu's absorb kernels on the CPU, no GPU needed (CI runs them): a model of
``mla_absorb_w``'s lane/column map over the resident layout; the CUDA source of
``mla_absorb_w`` against ``mla_absorb`` (g++ through a stand-in for the built-ins they use);
and ``mla_absorb_w``'s own q split against ``mla_absorb_w`` then ``mla_qsplit`` (one fiber per
CUDA thread, the inline PTX modelled: ``_attention_cpu``). The flash and merge kernels and the
host's flash choices: ``test_attention_flash_cpu.py``; the GPU tests of the same kernels:
``test_attention.py``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _attention_cpu import FIBER_SHIM, cpu_source
from _emulate import build_and_run
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


# mla_absorb_w<F, SB, true> (the q rows split by the absorb) against mla_absorb_w<F, SB, false>
# then mla_qsplit, on the same inputs; one new cache row per token scattered by both.
_QSPLIT_SHIM = (
    FIBER_SHIM
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
    build_and_run(tmp_path, _QSPLIT_SHIM, cpu_source(sources.source("attention.cu")), 240)
