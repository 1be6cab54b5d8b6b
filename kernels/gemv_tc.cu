// gemv_tc / moe_tc: the int4 decode products (fmt 2, and fmt 4 with group sizes that are
// multiples of 16) on tensor cores, with fp32-exact activations. Same jobs, same results
// (to ~2^-24 relative per term) as gemv / moe in gemv.cu, which keep every other case.
//
// Why: with fp32 FMA the decode GEMV spends ~4 ALU ops per int4 weight (unpack, int->float,
// fma, scale) and is issue bound at ~1.3 TB/s. Here one mma.m16n8k16 takes 256 weights per warp
// and the unpack costs 12 ops per 8 weights (prmt, shift, 2 x lop3 magic, bf16x2 fma), so the
// loop is bound by the 16-byte weight loads again.
//
// Numerics. A (16 weight rows x 16 k) holds the codes as bf16: (nibble | 0x4300) is exactly
// 128 + nibble, and one bf16x2 fma with (1, -136) gives nibble - 8 exactly. B (16 k x 8
// columns) holds each activation row s split three ways, x = hi + mid + lo with hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid) (both differences exact in fp32), in columns
// 3s, 3s+1, 3s+2: 24 significant bits over bf16's full exponent range, so no per-row scaling.
// Every product (4-bit integer x 8-bit mantissa) is exact and the tensor core sums in fp32; the
// three columns are added in fp32 at the end. Up to 2 activation rows fit one n=8 tile; SB = 4
// uses two (NT = 2), SB = 8 (split-K gemv only) three. Per-row scales (fmt 2) multiply the final sums; grouped scales (fmt 4)
// multiply each mma's 16-k partial, which lies in one group because gs % 16 == 0.
//
// Fragment mapping. The order of k inside one mma is free as long as A and B agree. Lane
// (gid = lane / 4, t = lane % 4) of a warp loads the 16-byte chunk t of the 64-byte step st of
// weight rows gid and gid + 8 (4 lanes read 64 contiguous bytes of a row; see common.cuh): 8
// quads, one mma each. For quad q, prmt puts the quad's bytes at bits 0 and 16, so the magic
// lop3 yields (n0, n2) and, after >> 4, (n1, n3): a0/a1 = (k0, k2) and a2/a3 = (k1, k3) of rows
// gid / gid + 8. The staged activations hold, per (step, quad, t), the 4 bf16 values
// (x[k0], x[k2], x[k1], x[k3]) of each column: one 8-byte shared load gives b0 and b1.
//
// Work: a block tile is TC_RG * 16 rows (of gate and up for DUAL) x all K. Its 8 warps split
// into TC_RG row groups x KS = 8 / TC_RG k slices (steps st = ks, ks + KS, ...: the slices of
// a row are read side by side); the slices meet in shared memory at the end (fixed order: the
// same bits on every call). gemv_tc_k / gemv_tc_sk (split-K, below) serve the same jobs with a
// row tile's K split over the blocks of a thread block cluster; gemv_st (gemv_stream.cuh) them
// too (fmt 4: power of two group sizes) with the weights streamed by the bulk-copy engine to
// one resident block per SM.
#include "common.cuh"
#include "jobs.cuh"
#include "tc.cuh"

#define TC_RG 2
#define TC_KS (GEMV_WARPS / TC_RG)

template <int SB> struct TcNT {
    static constexpr int value = (3 * SB + 7) / 8;  // n=8 tiles of the 3 * SB columns
};

// Staged index (in bf16 values, within one column) of tile element e: step e / 128 in memory
// order, then quad, then t, then (k0, k2, k1, k3). Columns are cstride values apart.
__device__ __forceinline__ int tc_stage_index(int e) {
    return ((e >> 10) * 8 + ((e >> 4) & 7)) * 128 + ((e >> 7) & 7) * 16 + ((e >> 2) & 3) * 4 +
           (((e & 1) << 1) | ((e >> 1) & 1));
}

// Rows [srow0, srow0 + SB) x columns [k0, k0 + ktile) of x (float32 [rows, x_stride]) ->
// xb (bf16 bits [3 * SB][cstride]), zero past in_features and past `rows`. ld.cg: moe's hidden
// activations were written earlier in the same launch by other blocks. Each thread issues all
// its loads (up to TC_STAGE_LOADS float4) before converting any: the staging costs one L2
// round trip, not one per element. The 4 values of a float4 (k0..k3 of one quad and lane)
// are one 8-byte slot of each column, stored as (k0, k2, k1, k3).
// NTHREADS: the threads staging (threads 0 .. NTHREADS - 1; 0: the whole block).
#define TC_STAGE_LOADS 4
template <int SB, int NL = TC_STAGE_LOADS, int NTHREADS = 0>
__device__ __forceinline__ void tc_stage(unsigned short *xb, int cstride,
                                         const float *__restrict__ x, int x_stride, int rows,
                                         int srow0, int in_features, int k0, int ktile) {
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
    const int nt = NTHREADS ? NTHREADS : (int)blockDim.x;
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        const bool ok = srow0 + s < rows;
        const float *xr = x + (size_t)(srow0 + s) * x_stride;
        unsigned short *d = xb + 3 * s * cstride;
        for (int e0 = threadIdx.x * 4; e0 < ktile; e0 += nt * 4 * NL) {
            float4 v[NL];
#pragma unroll
            for (int j = 0; j < NL; ++j) {
                const int gi = k0 + e0 + j * nt * 4;
                v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (!ok || e0 + j * nt * 4 >= ktile) continue;
                tc_load4(v[j], xr, gi, in_features, vec);
            }
#pragma unroll
            for (int j = 0; j < NL; ++j) {
                const int e = e0 + j * nt * 4;
                if (e >= ktile) break;
                unsigned short p[3][4];  // hi, mid, lo
                tc_split<3>(v[j], p);
                const int i = tc_stage_index(e);  // a multiple of 4: 8-byte aligned
#pragma unroll
                for (int c = 0; c < 3; ++c)
                    *reinterpret_cast<uint2 *>(d + c * cstride + i) = tc_slot(p[c]);
            }
        }
    }
}

// Ask L2 for the weight bytes [0, nbytes) of rows [r0, r0 + nrows) (clamped) of w: issued
// before the staging of a tile so that HBM streams while the activations are converted.
__device__ __forceinline__ void tc_prefetch(const unsigned char *w, int ld, int r0, int nrows,
                                            int out_rows, int nbytes) {
    const int lines = nbytes >> 7;
    for (int j = threadIdx.x; j < nrows * lines; j += blockDim.x) {
        const int r = min(r0 + j / lines, out_rows - 1);
        const unsigned char *p = w + (size_t)r * ld + (size_t)(j % lines) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// Steps in flight per lane of one warp: U * M * 2 16-byte loads (grouped scales: 16 floats per
// step per matrix beside them, so fewer steps).
template <int FMT, int M> struct TcU {
    static constexpr int U = FMT == 4 ? (M == 2 ? 1 : 2) : (M == 2 ? 2 : 4);
    static constexpr int QS = FMT == 4 ? 8 : 1;
};

// One batch of a warp's weight registers: the chunks of steps st0 + TC_KS * u (u < U) of rows
// ra / rb of each matrix, with their grouped scales (fmt 4).
template <int FMT, int M, int UU = TcU<FMT, M>::U> struct TcBatch {
    static constexpr int U = UU, QS = TcU<FMT, M>::QS;
    uint4 wa[U][M], wb[U][M];
    float qa[U][M][QS], qb[U][M][QS];
};

// Load a batch. pa/pb: rows ra/rb of each matrix at step 0 of the staged range (plus chunk t);
// step st is the 64 bytes at st * 64 (steps are consecutive 64-byte pieces of a row). base, for
// the scales' group index: AL, the element of st = 0 (a multiple of 1024); else its global step
// (128 elements: step gst covers elements (gst / 8) * 1024 + q * 128 + (gst % 8) * 16 + [0, 16)).
template <int FMT, int M, bool AL, bool SS = false, int UU>
__device__ __forceinline__ void tc_load(TcBatch<FMT, M, UU> &b, const unsigned char *const *pa,
                                        const unsigned char *const *pb,
                                        const float *const *sa, const float *const *sbr,
                                        const WGeom &g, int base, int st0, int nsteps) {
    constexpr int U = UU, QS = TcBatch<FMT, M, UU>::QS;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int st = st0 + TC_KS * u;
        if (st < nsteps) {
            const size_t off = (size_t)((st >> 3) * 32 + (st & 7) * 4) * 16;  // st * 64
#pragma unroll
            for (int m = 0; m < M; ++m) {
                b.wa[u][m] = __ldg(reinterpret_cast<const uint4 *>(pa[m] + off));
                b.wb[u][m] = __ldg(reinterpret_cast<const uint4 *>(pb[m] + off));
            }
            if (FMT == 4 && !SS) {  // SS: the scales are read from shared memory instead
                const int gst = base + st;
                const int e0 = AL ? base + (st >> 3) * 1024 + (st & 7) * 16
                                  : (gst >> 3) * 1024 + (gst & 7) * 16;
#pragma unroll
                for (int q = 0; q < QS; ++q) {
                    const int gi = coli_group(e0 + q * 128, g.gs, g.gs_shift);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        b.qa[u][m][q] = __ldg(sa[m] + gi);
                        b.qb[u][m][q] = __ldg(sbr[m] + gi);
                    }
                }
            }
        }
    }
}

// acc[m][nt] += the batch's weights x the staged activations (xcol: each n-tile's column for
// this lane at step 0 of the staged range).
template <int FMT, int SB, int M, int UU>
__device__ __forceinline__ void tc_compute(float (&acc)[M][TcNT<SB>::value][4],
                                           const TcBatch<FMT, M, UU> &b,
                                           const unsigned short *const *xcol, int st0,
                                           int nsteps) {
    constexpr int NT = TcNT<SB>::value;
    constexpr int U = UU, QS = TcBatch<FMT, M, UU>::QS;
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int st = st0 + TC_KS * u;
        if (st >= nsteps) break;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            uint2 bv[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                bv[nt] = *reinterpret_cast<const uint2 *>(xcol[nt] + st * 128 + q * 16);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                unsigned int a0, a1, a2, a3;
                tc_quad(b.wa[u][m], q, a0, a2);
                tc_quad(b.wb[u][m], q, a1, a3);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    if (FMT == 4) {
                        float d[4];
                        tc_mma(d, a0, a1, a2, a3, bv[nt], zero);
                        const float s0 = b.qa[u][m][q & (QS - 1)], s1 = b.qb[u][m][q & (QS - 1)];
                        acc[m][nt][0] = fmaf(s0, d[0], acc[m][nt][0]);
                        acc[m][nt][1] = fmaf(s0, d[1], acc[m][nt][1]);
                        acc[m][nt][2] = fmaf(s1, d[2], acc[m][nt][2]);
                        acc[m][nt][3] = fmaf(s1, d[3], acc[m][nt][3]);
                    } else {
                        tc_mma(acc[m][nt], a0, a1, a2, a3, bv[nt], acc[m][nt]);
                    }
                }
            }
        }
    }
}

// This lane's column of each n-tile in a staged tile.
template <int SB>
__device__ __forceinline__ void tc_cols(const unsigned short *(&xcol)[TcNT<SB>::value],
                                        const unsigned short *xb, int cstride, int lane) {
    constexpr int NT = TcNT<SB>::value, NC = 3 * SB;
    const int gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xcol[nt] = xb + min(nt * 8 + gid, NC - 1) * cstride + t * 4;
}

// One warp, steps ks, ks + TC_KS, ... < nsteps of the staged tile starting at element k0:
// acc[m][nt] += W_m[rows ra / rb, tile] x B. pa/pb: rows ra/rb of each matrix at chunk (k0/32 + t).
template <int FMT, int SB, int M>
__device__ __forceinline__ void tc_warp(float (&acc)[M][TcNT<SB>::value][4],
                                        const unsigned short *xb, int cstride,
                                        const unsigned char *const *pa,
                                        const unsigned char *const *pb, const float *const *sa,
                                        const float *const *sbr,
                                        const WGeom &g, int k0, int nsteps, int ks, int lane) {
    constexpr int U = TcU<FMT, M>::U;
    const unsigned short *xcol[TcNT<SB>::value];
    tc_cols<SB>(xcol, xb, cstride, lane);
    for (int st0 = ks; st0 < nsteps; st0 += TC_KS * U) {
        TcBatch<FMT, M> b;
        tc_load<FMT, M, true>(b, pa, pb, sa, sbr, g, k0, st0, nsteps);
        tc_compute<FMT, SB, M>(acc, b, xcol, st0, nsteps);
    }
}

// Shared memory of one block: the k-slice partials, then the staged activations.
template <int SB> __host__ __device__ constexpr int tc_red_floats() {
    return GEMV_WARPS * 2 * 16 * 8 * TcNT<SB>::value;  // TC_KS * TC_RG warps x M <= 2
}

// Rows [row0, row0 + TC_RG * 16) of one job over all K tiles, activation rows [srow0, +SB):
// y[srow, row] = f(sum) (per-row scale; DUAL: silu(gate) * up). All threads of the block call
// it (it has barriers).
template <int FMT, int SB, bool DUAL>
__device__ __forceinline__ void tc_block(float *red, unsigned short *xb, int kt,
                                         const float *__restrict__ x, int x_stride,
                                         float *__restrict__ y, int y_stride, int rows_s,
                                         int srow0, int out_rows, int row0,
                                         const unsigned char *w0, const float *sc0,
                                         const unsigned char *w1, const float *sc1,
                                         const WGeom &g) {
    constexpr int M = DUAL ? 2 : 1, NT = TcNT<SB>::value, NCOL = 8 * NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp % TC_RG, ks = warp / TC_RG;
    const int gid = lane >> 2, t = lane & 3;
    // Rows past out_rows load row out_rows - 1 (in bounds) and are never written.
    const int ra = min(row0 + rg * 16 + gid, out_rows - 1);
    const int rb = min(row0 + rg * 16 + gid + 8, out_rows - 1);
    const int cstride = kt + 16;  // bf16 values: columns 32 bytes apart mod 128 (banks)
    const unsigned char *pa[M], *pb[M];
    const float *sa[M], *sbr[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const unsigned char *w = m ? w1 : w0;
        const float *sc = m ? sc1 : sc0;
        pa[m] = w + (size_t)ra * g.ld + t * 16;
        pb[m] = w + (size_t)rb * g.ld + t * 16;
        sa[m] = sc + (size_t)ra * g.ngp;
        sbr[m] = sc + (size_t)rb * g.ngp;
    }
    float acc[M][NT][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[m][nt][j] = 0.f;

    tc_prefetch(w0, g.ld, row0, TC_RG * 16, out_rows, min(kt, g.in_padded) >> 1);
    if (DUAL) tc_prefetch(w1, g.ld, row0, TC_RG * 16, out_rows, min(kt, g.in_padded) >> 1);
    for (int k0 = 0; k0 < g.in_padded; k0 += kt) {
        const int ktile = min(kt, g.in_padded - k0);
        __syncthreads();  // the previous tile is consumed
        tc_stage<SB>(xb, cstride, x, x_stride, rows_s, srow0, g.in_features, k0, ktile);
        __syncthreads();
        const unsigned char *qa[M], *qb[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            qa[m] = pa[m] + (size_t)(k0 >> 5) * 16;
            qb[m] = pb[m] + (size_t)(k0 >> 5) * 16;
        }
        tc_warp<FMT, SB, M>(acc, xb, cstride, qa, qb, sa, sbr, g, k0, ktile >> 7, ks, lane);
    }
    // Partials [ks][rg][m][16 rows][NCOL columns] (c0, c1: row gid; c2, c3: row gid + 8).
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float *p = red + ((ks * TC_RG + rg) * M + m) * 16 * NCOL + nt * 8 + 2 * t;
            p[gid * NCOL] = acc[m][nt][0];
            p[gid * NCOL + 1] = acc[m][nt][1];
            p[(gid + 8) * NCOL] = acc[m][nt][2];
            p[(gid + 8) * NCOL + 1] = acc[m][nt][3];
        }
    __syncthreads();
    for (int o = threadIdx.x; o < TC_RG * 16 * SB; o += blockDim.x) {
        const int s = o / (TC_RG * 16), rr = o - s * (TC_RG * 16);
        const int row = row0 + rr, srow = srow0 + s;
        if (row >= out_rows || srow >= rows_s) continue;
        const int rgo = rr >> 4, r = rr & 15;
        float v[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < TC_KS; ++k) {
                const float *p = red + ((k * TC_RG + rgo) * M + m) * 16 * NCOL + r * NCOL + 3 * s;
                sum += (p[0] + p[1]) + p[2];
            }
            if (FMT == 2) sum *= (m ? sc1 : sc0)[row];
            v[m] = sum;
        }
        y[(size_t)srow * y_stride + row] = coli_out<DUAL>(v[0], v[M - 1]);
    }
}

// grid (ceil(max_out / (TC_RG * 16)), n_jobs, ceil(max_rows / SB)), block GEMV_WARPS * 32,
// dynamic shared 4 * tc_red_floats<SB>() + 2 * 3 * SB * (kt + 16) bytes.
template <int FMT, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
gemv_tc(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp,
        int gs, int gs_shift, int kt) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.y];
    const int row0 = blockIdx.x * (TC_RG * 16);
    const int srow0 = blockIdx.z * SB;
    if (row0 >= job.out_rows || srow0 >= job.rows) return;  // whole block: no barrier skipped
    extern __shared__ float4 smem4[];
    float *red = reinterpret_cast<float *>(smem4);
    unsigned short *xb = reinterpret_cast<unsigned short *>(red + tc_red_floats<SB>());
    tc_block<FMT, SB, false>(red, xb, kt, reinterpret_cast<const float *>(job.x), job.x_stride,
                             reinterpret_cast<float *>(job.y), job.y_stride, job.rows, srow0,
                             job.out_rows, row0, reinterpret_cast<const unsigned char *>(job.w0),
                             reinterpret_cast<const float *>(job.s0), nullptr, nullptr, g);
}

#include "gemv_tc_splitk.cuh"
// A whole expert group in one persistent launch: moe in gemv.cu (the same queue of tiles,
// moe_queue in jobs.cuh, and arguments), with TC_RG * 16-row tiles in both phases.
template <int FMT, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
moe_tc(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs, int ntiles_a_row,
       int ntiles_b_row, int nz, int a_in, int a_in_padded, int a_ld, int a_ngp, int a_gs,
       int a_gs_shift, int b_in, int b_in_padded, int b_ld, int b_ngp, int b_gs,
       int b_gs_shift, int kt) {
    const WGeom ga{a_in, a_in_padded, a_ld, a_ngp, a_gs, a_gs_shift};
    const WGeom gb{b_in, b_in_padded, b_ld, b_ngp, b_gs, b_gs_shift};
    extern __shared__ float4 smem4[];
    float *red = reinterpret_cast<float *>(smem4);
    unsigned short *xb = reinterpret_cast<unsigned short *>(red + tc_red_floats<SB>());
    moe_queue<TC_RG * 16, TC_RG * 16, SB>(
        jobs, ctr, n_jobs, ntiles_a_row, ntiles_b_row, nz, ga, gb,
        [&](auto... a) { tc_block<FMT, SB, true>(red, xb, kt, a...); },
        [&](auto... a) { tc_block<FMT, SB, false>(red, xb, kt, a...); });
}

#include "moe_tc_fast.cuh"
#include "gemv_stream.cuh"
