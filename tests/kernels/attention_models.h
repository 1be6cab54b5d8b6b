// Models of attention.cu's inline PTX for the tests that run its kernels' source on the CPU
// (test_attention_cpu.py, test_attention_flash_cpu.py), after fibers.h (which stands in for the
// warp shuffle by an exchange at a warp barrier): mma.m16n8k8 tf32 and mma.m16n8k16 f16 by the
// PTX manual's fragment layouts (operands cut to tf32 / read as fp16, each sum in float64 across
// the warp's lanes: fibers.h's warp_mma), cp.async by a copy (zero fill for n = 0), the fp16
// split of a q row (binary16 by round to nearest even, and the remainder's), and ldmatrix .x4 /
// .x2 (.trans) through the warp's slots. cluster_models.h has the DSMEM and cluster ones.
#pragma once
#include "fibers.h"
inline double tf32(unsigned u) { return (double)__uint_as_float(u & 0xffffe000u); }
inline void fl_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                   unsigned b0, unsigned b1) {
    double s[4];
    warp_mma<8>(
        s, {a0, a1, a2, a3, b0, b1},
        [](auto u, int r, int k) {
            return tf32(u[(r & 7) * 4 + (k & 3)][(r >> 3) + 2 * (k >> 2)]);
        },
        [](auto u, int k, int n) { return tf32(u[n * 4 + (k & 3)][4 + (k >> 2)]); });
    for (int e = 0; e < 4; ++e) d[e] = (float)(s[e] + d[e]);
}
inline void fl_cpn(float *dst, const float *src, int n, int b) {
    if (n) std::memcpy(dst, src, b);
    else std::memset(dst, 0, b);
}
inline void fl_cp4(float *dst, const float *src, int n) { fl_cpn(dst, src, n, 4); }
inline void fl_cp16(float *dst, const float *src, int n) { fl_cpn(dst, src, n, 16); }
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
    double s[4];
    warp_mma<16>(
        s, {a[0], a[1], a[2], a[3], b0, b1},
        [](auto u, int r, int k) {
            return hpart(u[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k);
        },
        [](auto u, int k, int n) { return hpart(u[n * 4 + ((k & 7) >> 1)][4 + (k >> 3)], k); });
    for (int e = 0; e < 4; ++e) d[e] = (float)(s[e] + d[e]);
}
// ldmatrix .x4 / .x2 (.trans): every lane leaves its row address, then reads its pairs.
template <int N, bool T>
inline void fh_ldsm(unsigned (&r)[4], const unsigned short *p) {
    const int lane = threadIdx.x & 31;
    warp_exchange(&p, sizeof p, [&](const unsigned (*u)[8]) {
        auto row = [&](int l) {
            const unsigned short *q;
            std::memcpy(&q, u[l], sizeof q);
            return q;
        };
        for (int i = 0; i < N; ++i) {
            if (T) r[i] = row(8 * i + 2 * (lane & 3))[lane >> 2]
                        | (unsigned)row(8 * i + 2 * (lane & 3) + 1)[lane >> 2] << 16;
            else { std::memcpy(&r[i], row(8 * i + (lane >> 2)) + 2 * (lane & 3), 4); }
        }
    });
}
inline void fh_ldsm4(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<4, false>(r, p); }
inline void fh_ldsm4t(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<4, true>(r, p); }
inline void fh_ldsm2t(unsigned (&r)[4], const unsigned short *p) { fh_ldsm<2, true>(r, p); }
