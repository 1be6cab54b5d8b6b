// Tensor-core primitives of the int4 kernels (gemv_tc.cu, prefill_tc.cu, and any kernel that
// feeds int4 weights to mma.sync as bf16): float <-> bf16 bits, the nibble-to-bf16 magic, the
// m16n8k16 bf16 mma with fp32 accumulate, and the pieces of their activation staging (a quad
// of x, split into bf16 parts). See gemv_tc.cu's header for the numerics. Also the integer
// form (tc_mma_q8: m16n8k32, codes as u8 against activations split in int8 parts, int32
// sums; gemv_stream.cuh's Q8 path explains its numerics).
#pragma once

__device__ __forceinline__ unsigned short tc_bf16(float v) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

__device__ __forceinline__ float tc_f32(unsigned short h) {
    return __uint_as_float(static_cast<unsigned int>(h) << 16);
}

// (x & 0x000F000F) | 0x43004300 -> bf16x2 (128 + nibble), then * 1 - 136 -> nibble - 8.
__device__ __forceinline__ unsigned int tc_nib2(unsigned int x) {
    unsigned int r, d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "r"(0x000F000Fu), "r"(0x43004300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(0x3F803F80u), "r"(0xC308C308u));
    return d;
}

// Quad q of a chunk (words w) -> (k0, k2) in lo, (k1, k3) in hi, as bf16x2 values nibble - 8.
__device__ __forceinline__ void tc_quad(const uint4 &c, int q, unsigned int &lo, unsigned int &hi) {
    const unsigned int w[4] = {c.x, c.y, c.z, c.w};
    unsigned int x;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(x) : "r"(w[q >> 1]), "r"((q & 1) ? 0x3322u : 0x1100u));
    lo = tc_nib2(x);
    hi = tc_nib2(x >> 4);
}

__device__ __forceinline__ void tc_mma(float (&d)[4], unsigned int a0, unsigned int a1,
                                       unsigned int a2, unsigned int a3, uint2 b,
                                       const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
}

// v = x[gi, gi + 4) of one float32 row where it lies before in_features (v is zero on entry):
// one 16-byte load where rows are 16-byte aligned (vec) and all 4 lie before in_features.
// ld.cg: moe's hidden activations were written earlier in the same launch by other blocks.
__device__ __forceinline__ void tc_load4(float4 &v, const float *__restrict__ xr, int gi,
                                         int in_features, bool vec) {
    if (vec && gi + 4 <= in_features) {
        v = __ldcg(reinterpret_cast<const float4 *>(xr + gi));
    } else {
        if (gi < in_features) v.x = __ldcg(xr + gi);
        if (gi + 1 < in_features) v.y = __ldcg(xr + gi + 1);
        if (gi + 2 < in_features) v.z = __ldcg(xr + gi + 2);
        if (gi + 3 < in_features) v.w = __ldcg(xr + gi + 3);
    }
}

// The 4 values k0..k3 of one quad split into N bf16 parts, x = p0 + p1 + ... (each remainder
// exact in fp32), each in the order (k0, k2, k1, k3) of a staged column's 8-byte slot: the B
// fragment order of gemv_tc.cu and prefill_tc.cu.
template <int N>
__device__ __forceinline__ void tc_split(const float4 &v, unsigned short (&p)[N][4]) {
    const float f[4] = {v.x, v.z, v.y, v.w};  // (k0, k2, k1, k3)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float r = f[k];
#pragma unroll
        for (int n = 0; n < N; ++n) {
            p[n][k] = tc_bf16(r);
            if (n + 1 < N) r -= tc_f32(p[n][k]);
        }
    }
}

// One part of tc_split as the 8 bytes of its slot.
__device__ __forceinline__ uint2 tc_slot(const unsigned short (&p)[4]) {
    return make_uint2(p[0] | (unsigned int)p[1] << 16, p[2] | (unsigned int)p[3] << 16);
}

// d = A x B + c on the integer tensor-core path: A (16 rows x 32 k) 8-bit, unsigned (the int4
// codes 0..15, unpacked by masks) or, SA, signed; B (32 k x 8 columns) signed 8-bit; int32
// sums (exact). Fragments as the PTX manual's m16n8k32: a0 / a1 rows gid / gid + 8 at k = 4 t
// + [0, 4), a2 / a3 at k = 16 + 4 t + [0, 4); b0 / b1 column gid at the same k; c0, c1 row gid
// and c2, c3 row gid + 8, columns 2 t, 2 t + 1.
template <bool SA> __device__ __forceinline__ void tc_mma_q8(
    int (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3, uint2 b,
    const int (&c)[4]) {
    if (SA)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%10,%11,%12,%13};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y), "r"(c[0]), "r"(c[1]),
              "r"(c[2]), "r"(c[3]));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%10,%11,%12,%13};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y), "r"(c[0]), "r"(c[1]),
              "r"(c[2]), "r"(c[3]));
}
