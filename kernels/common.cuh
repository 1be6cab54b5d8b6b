// Shared device helpers: the resident weight layout and its decoders.
//
// Resident layout (ours; made once at place time by kernels/layout.py). Every row of a weight
// tensor [O, I] is padded to whole 512-byte blocks; a block is 32 lanes x one 16-byte chunk. A
// chunk holds QUADS quads of 4 elements, and quad q of lane l in block b holds the elements
//     b * BLK + q * 128 + l * 4 + {0, 1, 2, 3}          (BLK = QUADS * 128 elements per block)
// so when the 32 lanes of a warp each load their chunk with one 16-byte load (one 512-byte
// coalesced transaction), the activations quad q needs are one float4 per lane at consecutive
// addresses: shared-memory reads free of bank conflicts. Within a chunk, the elements
// j = 4 * q + k are packed in the client's order (int4: low nibble first, int2: low bits
// first). Values keep the client's offset-binary codes; padding elements meet x = 0.
//
// Decoding uses the 2^23 trick: the float with bits 0x4B000000 | c is exactly 2^23 + c, so one
// logic op and one subtraction (which also removes the offset) turn a code c into a float.
#pragma once

template <int FMT> struct Fmt;
template <> struct Fmt<0> { static constexpr int QUADS = 1; };   // 4 x float32
template <> struct Fmt<1> { static constexpr int QUADS = 4; };   // 16 x int8
template <> struct Fmt<2> { static constexpr int QUADS = 8; };   // 32 x int4, per-row scale
template <> struct Fmt<3> { static constexpr int QUADS = 16; };  // 64 x int2
template <> struct Fmt<4> { static constexpr int QUADS = 8; };   // 32 x int4, grouped scales

#define COLI_BLOCK_BYTES 512
// NVRTC has no <math.h> INFINITY.
#define COLI_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float coli_magic(unsigned int code, float bias) {
    return __uint_as_float(0x4B000000u | code) - bias;
}

// Quad q (compile-time after unrolling) of a 16-byte chunk -> 4 floats, offsets removed, unscaled.
template <int FMT>
__device__ __forceinline__ void decode_quad(const uint4 &c, int q, float v[4]) {
    const unsigned int w[4] = {c.x, c.y, c.z, c.w};
    if (FMT == 0) {
        v[0] = __uint_as_float(c.x); v[1] = __uint_as_float(c.y);
        v[2] = __uint_as_float(c.z); v[3] = __uint_as_float(c.w);
    } else if (FMT == 1) {
        // int8 two's complement -> offset-binary by flipping the sign bit.
        const unsigned int b = w[q] ^ 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = coli_magic((b >> (8 * k)) & 0xFFu, 8388608.f + 128.f);
    } else if (FMT == 2 || FMT == 4) {
        const unsigned int h = w[q >> 1] >> (16 * (q & 1));
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = coli_magic((h >> (4 * k)) & 0xFu, 8388608.f + 8.f);
    } else {
        const unsigned int b = w[q >> 2] >> (8 * (q & 3));
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = coli_magic((b >> (2 * k)) & 0x3u, 8388608.f + 2.f);
    }
}

// Group index of element i for fmt 4 (shift when gs is a power of two).
__device__ __forceinline__ int coli_group(int i, int gs, int gs_shift) {
    return gs_shift >= 0 ? (i >> gs_shift) : (i / gs);
}

// One dequantized element W[o, i] (scale applied); row points at row o's first byte. Slow path
// for kernels that walk a weight along its rows (the absorbed q of MLA).
template <int FMT>
__device__ __forceinline__ float load_elem(const unsigned char *__restrict__ row,
                                           const float *__restrict__ scales, int o, int i,
                                           int ngp, int gs, int gs_shift) {
    constexpr int BLK = Fmt<FMT>::QUADS * 128;
    const int b = i / BLK, e = i - b * BLK;
    const int q = e >> 7, l = (e >> 2) & 31, k = e & 3;
    const unsigned char *chunk = row + b * COLI_BLOCK_BYTES + l * 16;
    const int j = 4 * q + k;
    if (FMT == 0) return reinterpret_cast<const float *>(chunk)[j];
    if (FMT == 1) return float(static_cast<signed char>(chunk[j])) * scales[o];
    if (FMT == 3) return float(int((chunk[j >> 2] >> (2 * (j & 3))) & 3) - 2) * scales[o];
    const float v = float(int((chunk[j >> 1] >> (4 * (j & 1))) & 15) - 8);
    if (FMT == 2) return v * scales[o];
    return v * scales[(size_t)o * ngp + coli_group(i, gs, gs_shift)];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// What an output tile stores: the sum, or for a DUAL tile (gate and up) silu(gate) * up.
template <bool DUAL> __device__ __forceinline__ float coli_out(float gate, float up) {
    return DUAL ? gate / (1.f + expf(-gate)) * up : gate;
}
