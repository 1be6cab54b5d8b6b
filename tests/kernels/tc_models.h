// Models of tc.cuh's inline PTX for the tests that run an int4 tensor-core kernel's source on
// the CPU (test_gemv_stream_cpu.py, test_prefill_tc_cpu.py, test_moe_wq_cpu.py): bf16
// rounding, prmt, the nibble magic, and mma.m16n8k16 bf16 / m16n8k32 s8 by the PTX manual's
// fragment layouts, each mma summed in float64 (int64 for s8) across the warp's lanes
// (fibers.h: warp_mma); and the resident int4 layout's decoder their float64 checks use.
#pragma once
#include "fibers.h"
// The resident int4 layout's element e of a row (common.cuh: load_elem), nibble - 8.
inline int code(const unsigned char *row, int e) {
    const int b = e / 1024, r = e % 1024, q = r >> 7, l = (r >> 2) & 31, k = r & 3, j = 4 * q + k;
    return ((row[b * 512 + l * 16 + (j >> 1)] >> (4 * (j & 1))) & 15) - 8;
}
inline unsigned short tc_bf16(float v) {  // cvt.rn.bf16.f32: round to nearest even
    const unsigned u = __float_as_uint(v);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float f32_of(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
inline unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    const unsigned long long v = (unsigned long long)b << 32 | a;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i)
        r |= (unsigned)((v >> (8 * ((sel >> (4 * i)) & 7))) & 255) << (8 * i);
    return r;
}
inline unsigned tc_nib2(unsigned x) {
    const unsigned r = (x & 0x000F000Fu) | 0x43004300u;
    unsigned d = 0;
    for (int h = 0; h < 2; ++h) {  // fma.rn.bf16x2 r * 1 - 136: exact
        const float f = f32_of((unsigned short)(r >> (16 * h))) * 1.f - 136.f;
        d |= (unsigned)tc_bf16(f) << (16 * h);
    }
    return d;
}
inline void tc_quad(const uint4 &c, int q, unsigned &lo, unsigned &hi) {
    const unsigned w[4] = {c.x, c.y, c.z, c.w};
    const unsigned x = prmt(w[q >> 1], 0, (q & 1) ? 0x3322u : 0x1100u);
    lo = tc_nib2(x);
    hi = tc_nib2(x >> 4);
}
inline double bf(unsigned reg, int half) { return f32_of((unsigned short)(reg >> (16 * half))); }
inline void tc_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, uint2 b,
                   const float (&c)[4]) {
    // A [16 x 16]: (r, k) in lane (r % 8) * 4 + (k % 8) / 2, register r / 8 + 2 (k / 8), half
    // k % 2; B [16 x 8]: (k, n) in lane n * 4 + (k % 8) / 2, register 4 + k / 8, half k % 2.
    double s[4];
    warp_mma<16>(
        s, {a0, a1, a2, a3, b.x, b.y},
        [](auto u, int r, int k) {
            return bf(u[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k & 1);
        },
        [](auto u, int k, int n) { return bf(u[n * 4 + ((k & 7) >> 1)][4 + (k >> 3)], k & 1); });
    for (int e = 0; e < 4; ++e) d[e] = (float)(s[e] + c[e]);
}
// mma.m16n8k32 u8 (SA: s8) x s8 -> s32. A [16 x 32]: (r, k) in lane (r % 8) * 4 + (k % 16) / 4,
// register r / 8 + 2 (k / 16), byte k % 4; B [32 x 8]: (k, n) in lane n * 4 + (k % 16) / 4,
// register 4 + k / 16, byte k % 4. Sums in int64, checked to fit int32 (the kernel's bound).
template <bool SA>
inline void tc_mma_q8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, uint2 b,
                      const int (&c)[4]) {
    auto byte = [](unsigned reg, int k) { return (reg >> (8 * (k & 3))) & 255u; };
    long long s[4];
    warp_mma<32>(
        s, {a0, a1, a2, a3, b.x, b.y},
        [&](auto u, int r, int k) {
            const unsigned v = byte(u[(r & 7) * 4 + ((k & 15) >> 2)][(r >> 3) + 2 * (k >> 4)], k);
            return SA ? (long long)(signed char)v : (long long)v;
        },
        [&](auto u, int k, int n) {
            return (long long)(signed char)byte(u[n * 4 + ((k & 15) >> 2)][4 + (k >> 4)], k);
        });
    for (int e = 0; e < 4; ++e) {
        const long long acc = c[e] + s[e];
        if (acc != (int)acc) { std::printf("mma q8: int32 overflow\n"); std::exit(4); }
        d[e] = (int)acc;
    }
}
