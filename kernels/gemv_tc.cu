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
// row tile's K split over the blocks of a thread block cluster.
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
#define TC_STAGE_LOADS 4
template <int SB, int NL = TC_STAGE_LOADS>
__device__ __forceinline__ void tc_stage(unsigned short *xb, int cstride,
                                         const float *__restrict__ x, int x_stride, int rows,
                                         int srow0, int in_features, int k0, int ktile) {
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        const bool ok = srow0 + s < rows;
        const float *xr = x + (size_t)(srow0 + s) * x_stride;
        unsigned short *d = xb + 3 * s * cstride;
        for (int e0 = threadIdx.x * 4; e0 < ktile; e0 += blockDim.x * 4 * NL) {
            float4 v[NL];
#pragma unroll
            for (int j = 0; j < NL; ++j) {
                const int gi = k0 + e0 + j * blockDim.x * 4;
                v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (!ok || e0 + j * (int)blockDim.x * 4 >= ktile) continue;
                tc_load4(v[j], xr, gi, in_features, vec);
            }
#pragma unroll
            for (int j = 0; j < NL; ++j) {
                const int e = e0 + j * blockDim.x * 4;
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

// ---- split-K decode (gemv_tc_k, gemv_tc_sk): the same jobs and numerics as gemv_tc ----
//
// gemv_tc gives each block a 32-row tile and all of K: 6144 output rows are 192 blocks on 132
// SMs, each streaming every byte of its rows through a few dependent load round trips. Here a
// row tile is computed by a thread block cluster of C blocks (C = 2, 4, 8: __cluster_dims__;
// gemv_tc_k is C = 1): rank r of the cluster takes the contiguous global steps
// [r * N / C, (r + 1) * N / C) of K (N = in_padded / 128 steps of 64 bytes per row), stages
// only its part of the activations and issues its warps' first weight batch before the
// staging (the staging's L2 round trip and the weights' HBM round trip overlap). Within a
// block, warps split rows and steps as in gemv_tc and meet in shared memory; the C block sums
// then meet through distributed shared memory: every block writes its partial per output,
// cluster barrier, and rank r reads the C partials of outputs o = r, r + C, ... in rank order
// 0, 1, ..., C - 1 and writes y. Fixed order everywhere: the same bits on every call (not the
// same bits as gemv_tc, whose sum runs in another order). No float atomics, no scratch memory.
//
// DSMEM and the cluster barrier are inline PTX (mapa, ld.shared::cluster, barrier.cluster):
// the instructions cooperative_groups' cluster.map_shared_rank and cluster.sync compile to,
// without its headers (NVRTC as CuPy calls it needs no include path for them).

__device__ __forceinline__ unsigned int coli_cluster_rank() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// All threads of all blocks of the cluster; shared-memory writes before it are visible to the
// cluster's reads after it.
__device__ __forceinline__ void coli_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The last barrier of a cluster: no ordering of memory is needed (a block's reads of another's
// shared memory have returned before it arrives), only that none leaves early.
__device__ __forceinline__ void coli_cluster_wait_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\t"
                 "barrier.cluster.wait.aligned;" ::: "memory");
}

// p[0] in the shared memory of block `rank` of this cluster (p: this block's copy).
__device__ __forceinline__ float coli_dsmem_load(const float *p, unsigned int rank) {
    unsigned int local, remote;
    float v;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(local) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Global steps [gst0, gst0 + nst) of x rows [srow0, srow0 + SB) -> xb as tc_stage lays out a
// tile (bf16 hi, mid, lo columns cstride values apart), from step gst0: the staged index of
// float4 slot i = (step i / 32, quad (i / 4) % 8, lane t = i % 4) is 4 * i.
template <int SB>
__device__ __forceinline__ void tc_stage_steps(unsigned short *xb, int cstride,
                                               const float *__restrict__ x, int x_stride,
                                               int rows, int srow0, int in_features, int gst0,
                                               int nst) {
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
    const int nslot = nst * 32;
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        const bool ok = srow0 + s < rows;
        const float *xr = x + (size_t)(srow0 + s) * x_stride;
        unsigned short *d = xb + 3 * s * cstride;
        for (int i0 = threadIdx.x; i0 < nslot; i0 += blockDim.x * TC_STAGE_LOADS) {
            float4 v[TC_STAGE_LOADS];
#pragma unroll
            for (int j = 0; j < TC_STAGE_LOADS; ++j) {
                const int i = i0 + j * blockDim.x;
                v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (!ok || i >= nslot) continue;
                const int gst = gst0 + (i >> 5);
                const int e = (gst >> 3) * 1024 + ((i >> 2) & 7) * 128 + (gst & 7) * 16 +
                              (i & 3) * 4;
                tc_load4(v[j], xr, e, in_features, vec);
            }
#pragma unroll
            for (int j = 0; j < TC_STAGE_LOADS; ++j) {
                const int i = i0 + j * blockDim.x;
                if (i >= nslot) break;
                unsigned short p[3][4];  // hi, mid, lo
                tc_split<3>(v[j], p);
#pragma unroll
                for (int c = 0; c < 3; ++c)
                    *reinterpret_cast<uint2 *>(d + c * cstride + 4 * i) = tc_slot(p[c]);
            }
        }
    }
}

// L2 prefetch of bytes [b0, b0 + nbytes) of rows [r0, r0 + nrows) (clamped) of w.
__device__ __forceinline__ void tc_prefetch_range(const unsigned char *w, int ld, int r0,
                                                  int nrows, int out_rows, int b0, int nbytes) {
    if (nbytes <= 0) return;
    const int l0 = b0 >> 7, lines = ((b0 + nbytes + 127) >> 7) - l0;
    for (int j = threadIdx.x; j < nrows * lines; j += blockDim.x) {
        const int r = min(r0 + j / lines, out_rows - 1);
        const unsigned char *p = w + (size_t)r * ld + (size_t)(l0 + j % lines) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// Shared floats ahead of the staged activations: the cluster partials (one per output of the
// tile: TC_RG * 16 rows x SB activation rows), then the k-slice partials of one matrix.
template <int SB> __host__ __device__ constexpr int tc_sk_part_floats() {
    return TC_RG * 16 * SB;
}
template <int SB> __host__ __device__ constexpr int tc_sk_red_floats() {
    return GEMV_WARPS * 16 * 8 * TcNT<SB>::value;
}

// Blocks per SM (__launch_bounds__): 3 (80 registers) where that costs no or few spills (fmt 2:
// none; fmt 4 at one row: the 4 scales of the first batch, held across the staging); fmt 4 at
// four rows keeps gemv_tc's 2 (128 registers; at 80 it spills 108 bytes).
template <int FMT, int SB> struct TcSkOcc {
    static constexpr int value = (FMT == 2 || SB == 1) ? 3 : 2;
};

// One block of a split-K launch: rank `rank` of C for rows [row0, row0 + TC_RG * 16) of the
// job, activation rows [srow0, srow0 + SB). kts: most steps staged at once (host: the shared
// memory it gave). All threads of all C blocks call it (barriers, cluster barriers).
template <int FMT, int SB, int C>
__device__ __forceinline__ void tc_sk_block(const GemvJob &job, const WGeom &g, int kts,
                                            int rank, int row0, int srow0) {
    constexpr int NT = TcNT<SB>::value, NCOL = 8 * NT, U = TcU<FMT, 1>::U;
    constexpr int NOUT = tc_sk_part_floats<SB>();
    extern __shared__ float4 smem4[];
    float *part = reinterpret_cast<float *>(smem4);
    float *red = part + NOUT;
    unsigned short *xb = reinterpret_cast<unsigned short *>(red + tc_sk_red_floats<SB>());
    const float *x = reinterpret_cast<const float *>(job.x);
    float *y = reinterpret_cast<float *>(job.y);
    const unsigned char *w = reinterpret_cast<const unsigned char *>(job.w0);
    const float *sc = reinterpret_cast<const float *>(job.s0);
    const int out_rows = job.out_rows;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp % TC_RG, ks = warp / TC_RG;
    const int gid = lane >> 2, t = lane & 3;
    const int ra = min(row0 + rg * 16 + gid, out_rows - 1);
    const int rb = min(row0 + rg * 16 + gid + 8, out_rows - 1);
    const int nall = g.in_padded >> 7;
    const int s0 = rank * nall / C, s1 = (rank + 1) * nall / C;
    const int cstride = kts * 128 + 16;  // as tc_block: columns 32 bytes apart mod 128
    const unsigned char *pa[1] = {w + (size_t)ra * g.ld + (size_t)s0 * 64 + t * 16};
    const unsigned char *pb[1] = {w + (size_t)rb * g.ld + (size_t)s0 * 64 + t * 16};
    const float *sa[1] = {sc + (size_t)ra * g.ngp};
    const float *sbr[1] = {sc + (size_t)rb * g.ngp};
    const unsigned short *xcol[NT];
    tc_cols<SB>(xcol, xb, cstride, lane);

    float acc[1][NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[0][nt][j] = 0.f;

    // The first batch in registers, the rest of the first tile asked of L2, then the staging.
    TcBatch<FMT, 1> b;
    const int n0 = min(kts, s1 - s0);
    tc_load<FMT, 1, false>(b, pa, pb, sa, sbr, g, s0, ks, n0);
    tc_prefetch_range(w, g.ld, row0, TC_RG * 16, out_rows, s0 * 64 + TC_KS * U * 64,
                      (n0 - TC_KS * U) * 64);
    for (int ts = s0; ts < s1; ts += kts) {
        const int n = min(kts, s1 - ts);
        if (ts != s0) {
            __syncthreads();  // the previous tile is consumed
            tc_prefetch_range(w, g.ld, row0, TC_RG * 16, out_rows, ts * 64, n * 64);
        }
        tc_stage_steps<SB>(xb, cstride, x, job.x_stride, job.rows, srow0, g.in_features, ts, n);
        __syncthreads();
        const unsigned char *qa[1] = {pa[0] + (size_t)(ts - s0) * 64};
        const unsigned char *qb[1] = {pb[0] + (size_t)(ts - s0) * 64};
        for (int st0 = ks; st0 < n; st0 += TC_KS * U) {
            if (ts != s0 || st0 != ks) tc_load<FMT, 1, false>(b, qa, qb, sa, sbr, g, ts, st0, n);
            tc_compute<FMT, SB, 1>(acc, b, xcol, st0, n);
        }
    }
    // k-slice partials [ks][rg][16 rows][NCOL columns], as tc_block.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float *p = red + (ks * TC_RG + rg) * 16 * NCOL + nt * 8 + 2 * t;
        p[gid * NCOL] = acc[0][nt][0];
        p[gid * NCOL + 1] = acc[0][nt][1];
        p[(gid + 8) * NCOL] = acc[0][nt][2];
        p[(gid + 8) * NCOL + 1] = acc[0][nt][3];
    }
    __syncthreads();
    // Output o = s * TC_RG * 16 + rr: this block's sum over its k slices (fixed order).
    for (int o = threadIdx.x; o < NOUT; o += blockDim.x) {
        const int s = o / (TC_RG * 16), rr = o - s * (TC_RG * 16);
        const int rgo = rr >> 4, r = rr & 15;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < TC_KS; ++k) {
            const float *p = red + (k * TC_RG + rgo) * 16 * NCOL + r * NCOL + 3 * s;
            sum += (p[0] + p[1]) + p[2];
        }
        if (C == 1) {
            const int row = row0 + rr, srow = srow0 + s;
            if (row < out_rows && srow < job.rows)
                y[(size_t)srow * job.y_stride + row] = FMT == 2 ? sum * sc[row] : sum;
        } else {
            part[o] = sum;
        }
    }
    if (C == 1) return;
    coli_cluster_sync();  // every block's partials are written
    for (int o = rank + C * threadIdx.x; o < NOUT; o += C * blockDim.x) {
        const int s = o / (TC_RG * 16), rr = o - s * (TC_RG * 16);
        const int row = row0 + rr, srow = srow0 + s;
        if (row >= out_rows || srow >= job.rows) continue;
        float v[C];
#pragma unroll
        for (int k = 0; k < C; ++k) v[k] = coli_dsmem_load(part + o, k);
        float sum = v[0];
#pragma unroll
        for (int k = 1; k < C; ++k) sum += v[k];
        y[(size_t)srow * job.y_stride + row] = FMT == 2 ? sum * sc[row] : sum;
    }
    coli_cluster_wait_exit();  // no block leaves while another reads its shared memory
}

// gemv_tc's jobs and arguments (kt: most steps staged at once, kts), split-K. gemv_tc_k: grid
// (ceil(max_out / (TC_RG * 16)), n_jobs, ceil(max_rows / SB)); gemv_tc_sk: the same with C
// times the blocks in x (C consecutive blocks: one cluster, one row tile). Block
// GEMV_WARPS * 32, dynamic shared 4 * (tc_sk_part_floats<SB>() + tc_sk_red_floats<SB>()) +
// 2 * 3 * SB * (kts * 128 + 16) bytes.
template <int FMT, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, TcSkOcc<FMT, SB>::value)
gemv_tc_k(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp,
          int gs, int gs_shift, int kts) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.y];
    const int row0 = blockIdx.x * (TC_RG * 16), srow0 = blockIdx.z * SB;
    if (row0 >= job.out_rows || srow0 >= job.rows) return;  // whole block
    tc_sk_block<FMT, SB, 1>(job, g, kts, 0, row0, srow0);
}

template <int FMT, int SB, int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(GEMV_WARPS * 32, TcSkOcc<FMT, SB>::value)
gemv_tc_sk(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp,
           int gs, int gs_shift, int kts) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.y];
    const int row0 = (blockIdx.x / C) * (TC_RG * 16), srow0 = blockIdx.z * SB;
    // The C blocks of a cluster share blockIdx.x / C, y and z: all leave or none does.
    if (row0 >= job.out_rows || srow0 >= job.rows) return;
    tc_sk_block<FMT, SB, C>(job, g, kts, (int)coli_cluster_rank(), row0, srow0);
}

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

// ---- moe_tc_f: moe_tc with its loads issued ahead (matmul.MOE_TC_FAST) ----
//
// The same tiles, the same per-tile computation and summation order as moe_tc (the same
// steps, products, scales, fmaf and reductions in the same order; tc_compute_ss is
// tc_compute with the scales read from shared memory): the same bits for every output. What
// changes is when and how bytes are asked for:
// - the next tile's ticket is taken one tile ahead (moe_queue_la in jobs.cuh), and after its
//   first barrier every tile asks L2 for the first round (TC_KS * U steps per row) of the
//   block's next tile;
// - a tile issues its first batch of weight loads (registers) and asks L2 for rounds
//   1..TC_PFD of its rows (fmt 4: then stages its scales) before anything else: before a
//   down tile's wait for its expert's gate+up tiles and before the activation staging, so HBM
//   streams meanwhile; the next K tile's first batch is likewise loaded before its staging;
// - while it runs, each warp asks L2 for the round TC_PFD + 1 rounds ahead of the one it
//   loads (its quarter of its row group's lines): a window of TC_PFD + 1 rounds per tile in
//   flight instead of whole tiles, which at 3 blocks per SM would overflow the 60 MB L2;
// - fmt 4: the tile's grouped scales are staged in shared memory once per tile instead of
//   8 scalar loads per row, matrix and step (tc_stage_scales);
// - 3 blocks per SM at one row where the register cap costs no spills (MoeTcF).
#define TC_PFD 3

// Per variant: blocks per SM (__launch_bounds__), steps per warp batch of the gate+up (UA) and
// down (UB) tiles, float4 loads in flight per thread in the staging (NL). U and NL group the
// loads only: tc_compute adds the same steps to the same accumulators in the same order for
// any U (u, then quad, then matrix: each accumulator takes steps ks, ks + TC_KS, ... in turn),
// so the bits do not change. Smaller batches and staging make room for the first batch held
// across the staging and for 3 blocks per SM; the L2 window (TC_PFD rounds) keeps the bytes in
// flight. ptxas (nvcc 13.0, sm_90): <2, 1> and <4, 1> 80 registers at 3 blocks, no spills (at
// TcU's U, or with NL = 4, <2, 1> spills 48-500 bytes); <2, 4> and <4, 4> keep 2 blocks (128
// registers): no spills, 4 bytes (moe_tc: 92 each); at 3 blocks they spill 32 and 108 bytes.
// (Shared memory may allow fewer: the host sizes the grid from the real occupancy.)
template <int FMT, int SB> struct MoeTcF {
    static constexpr bool FAST3 = SB == 1;
    static constexpr int OCC = FAST3 ? 3 : 2;
    static constexpr int UA = 1, UB = FAST3 ? 1 : TcU<FMT, 1>::U / 2, NL = FAST3 ? 2 : 4;
};

// L2 prefetch of one round of row group rows [rbase, rbase + 16) of the M matrices: the bytes
// [b0, b0 + TC_KS * U * 64) of each row (2 * U lines; clamped to the row's nb bytes), the
// row group's 4 k-slice warps a quarter each (ks: this warp's slice).
template <int M, int U>
__device__ __forceinline__ void tc_prefetch_round(const unsigned char *w0,
                                                  const unsigned char *w1, int ld, int rbase,
                                                  int out_rows, int b0, int nb, int ks,
                                                  int lane) {
    constexpr int N = 16 * M * 2 * U;  // lines of the round
    for (int idx = ks + TC_KS * lane; idx < N; idx += TC_KS * 32) {
        const int r = idx & 15, rest = idx >> 4, m = rest % M, j = rest / M;
        const int b = b0 + j * 128;
        if (b >= nb) continue;
        const int row = min(rbase + r, out_rows - 1);
        const unsigned char *p = (m ? w1 : w0) + (size_t)row * ld + b;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// fmt 4: the grouped scales of a tile's rows [row0, row0 + TC_RG * 16) (clamped) of the M
// matrices -> shared ssc[m * 32 + r][sstride] (sstride = ngp | 1: odd, so the 8 rows a warp's
// lanes read at once lie in 8 banks). Per step a lane reads 8 scales of each of its 2 rows and
// M matrices; from global memory each of those loads touches 8 cache lines (one per row), 32
// loads per step beside 4 weight loads: the L1 work that made fmt 4 twice as slow as fmt 2.
// The same values, so the same bits. 8 loads in flight per thread.
template <int M>
__device__ __forceinline__ void tc_stage_scales(float *ssc, int sstride, const float *sc0,
                                                const float *sc1, int ngp, int row0,
                                                int out_rows) {
    const int per_m = TC_RG * 16 * ngp, n = M * per_m;
    for (int i0 = threadIdx.x; i0 < n; i0 += blockDim.x * 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * blockDim.x;
            v[j] = 0.f;
            if (i >= n) continue;
            const int m = M == 2 && i >= per_m, k = i - m * per_m, r = k / ngp;
            const float *row = (m ? sc1 : sc0) + (size_t)min(row0 + r, out_rows - 1) * ngp;
            v[j] = __ldg(row + (k - r * ngp));
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * blockDim.x;
            if (i >= n) break;
            const int m = M == 2 && i >= per_m, k = i - m * per_m, r = k / ngp;
            ssc[(m * TC_RG * 16 + r) * sstride + (k - r * ngp)] = v[j];
        }
    }
}

// Floats of moe_tc_f's shared scales (fmt 4): the larger of a gate+up tile's (2 matrices) and
// a down tile's, rounded to 16 bytes. matmul._moe_tc computes the same.
__device__ __forceinline__ int tc_ssc_floats(int ngp_a, int ngp_b) {
    return (max(2 * TC_RG * 16 * (ngp_a | 1), TC_RG * 16 * (ngp_b | 1)) + 3) & ~3;
}

// tc_compute for fmt 4 with the scales in shared memory (ssa / ssb: this lane's rows ra / rb
// of matrix 0, mstride floats to the next matrix): the same products, scales and fmaf order.
// base: the element of step 0 (a multiple of 1024, as tc_load's AL).
template <int FMT, int SB, int M, int UU>
__device__ __forceinline__ void tc_compute_ss(float (&acc)[M][TcNT<SB>::value][4],
                                              const TcBatch<FMT, M, UU> &b,
                                              const unsigned short *const *xcol, int st0,
                                              int nsteps, const float *ssa, const float *ssb,
                                              int mstride, const WGeom &g, int base) {
    constexpr int NT = TcNT<SB>::value;
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < UU; ++u) {
        const int st = st0 + TC_KS * u;
        if (st >= nsteps) break;
        const int e0 = base + (st >> 3) * 1024 + (st & 7) * 16;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            uint2 bv[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                bv[nt] = *reinterpret_cast<const uint2 *>(xcol[nt] + st * 128 + q * 16);
            const int gi = coli_group(e0 + q * 128, g.gs, g.gs_shift);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                unsigned int a0, a1, a2, a3;
                tc_quad(b.wa[u][m], q, a0, a2);
                tc_quad(b.wb[u][m], q, a1, a3);
                const float s0 = ssa[m * mstride + gi], s1 = ssb[m * mstride + gi];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float d[4];
                    tc_mma(d, a0, a1, a2, a3, bv[nt], zero);
                    acc[m][nt][0] = fmaf(s0, d[0], acc[m][nt][0]);
                    acc[m][nt][1] = fmaf(s0, d[1], acc[m][nt][1]);
                    acc[m][nt][2] = fmaf(s1, d[2], acc[m][nt][2]);
                    acc[m][nt][3] = fmaf(s1, d[3], acc[m][nt][3]);
                }
            }
        }
    }
}

// tc_block with its loads ahead (see above); the same outputs, bit for bit. done / need: a
// down tile's wait (thread 0 spins until *done >= need; nullptr: none); next: moe_queue_la's
// prefetch of the block's next tile. All threads of the block call it (barriers).
template <int FMT, int SB, bool DUAL, class Next>
__device__ __forceinline__ void tc_block_f(float *red, unsigned short *xb, int kt, float *ssc,
                                           const float *__restrict__ x, int x_stride,
                                           float *__restrict__ y, int y_stride, int rows_s,
                                           int srow0, int out_rows, int row0,
                                           const unsigned char *w0, const float *sc0,
                                           const unsigned char *w1, const float *sc1,
                                           const WGeom &g, const int *done, int need,
                                           Next next) {
    constexpr int M = DUAL ? 2 : 1, NT = TcNT<SB>::value, NCOL = 8 * NT;
    constexpr int U = DUAL ? MoeTcF<FMT, SB>::UA : MoeTcF<FMT, SB>::UB;
    constexpr int RB = TC_KS * U * 64;  // bytes of a row per round
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp % TC_RG, ks = warp / TC_RG;
    const int gid = lane >> 2, t = lane & 3;
    const int ra = min(row0 + rg * 16 + gid, out_rows - 1);
    const int rb = min(row0 + rg * 16 + gid + 8, out_rows - 1);
    const int cstride = kt + 16;
    const int nb = g.in_padded >> 1;  // weight bytes of a row
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
    const unsigned short *xcol[NT];
    tc_cols<SB>(xcol, xb, cstride, lane);
    const int sstride = g.ngp | 1, mstride = TC_RG * 16 * sstride;  // fmt 4: shared scales
    const float *ssa = ssc + (rg * 16 + gid) * sstride, *ssb = ssa + 8 * sstride;

    // First: this warp's first batch in registers, rounds 1..TC_PFD asked of L2, fmt 4 the
    // tile's scales into shared memory (read after the barrier below); only then the wait
    // (down tiles) and the staging.
    TcBatch<FMT, M, U> b;
    tc_load<FMT, M, true, FMT == 4>(b, pa, pb, sa, sbr, g, 0, ks, min(kt, g.in_padded) >> 7);
    const int pf = min(TC_PFD * RB, nb - RB);
    tc_prefetch_range(w0, g.ld, row0, TC_RG * 16, out_rows, RB, pf);
    if (DUAL) tc_prefetch_range(w1, g.ld, row0, TC_RG * 16, out_rows, RB, pf);
    if (FMT == 4) tc_stage_scales<M>(ssc, sstride, sc0, sc1, g.ngp, row0, out_rows);
    if (done != nullptr && threadIdx.x == 0) {
        const volatile int *d = done;
        while (*d < need) __nanosleep(128);
        __threadfence();  // the expert's h stores are visible before the staging reads them
    }
    for (int k0 = 0; k0 < g.in_padded; k0 += kt) {
        const int ktile = min(kt, g.in_padded - k0), nsteps = ktile >> 7;
        __syncthreads();  // the previous tile is consumed (and thread 0's wait is over)
        tc_stage<SB, MoeTcF<FMT, SB>::NL>(xb, cstride, x, x_stride, rows_s, srow0,
                                          g.in_features, k0, ktile);
        __syncthreads();
        if (k0 == 0) next();
        const unsigned char *qa[M], *qb[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            qa[m] = pa[m] + (size_t)(k0 >> 5) * 16;
            qb[m] = pb[m] + (size_t)(k0 >> 5) * 16;
        }
        for (int st0 = ks; st0 < nsteps; st0 += TC_KS * U) {
            if (st0 != ks)
                tc_load<FMT, M, true, FMT == 4>(b, qa, qb, sa, sbr, g, k0, st0, nsteps);
            // This round starts at byte (k0 / 128 + st0 - ks) * 64 of the row.
            tc_prefetch_round<M, U>(w0, w1, g.ld, row0 + rg * 16, out_rows,
                                    (k0 >> 1) + (st0 - ks) * 64 + (TC_PFD + 1) * RB, nb, ks,
                                    lane);
            if (FMT == 4)
                tc_compute_ss<FMT, SB, M>(acc, b, xcol, st0, nsteps, ssa, ssb, mstride, g, k0);
            else
                tc_compute<FMT, SB, M>(acc, b, xcol, st0, nsteps);
        }
        const int kn = k0 + kt;
        if (kn < g.in_padded) {  // the next K tile's first batch, before its staging
#pragma unroll
            for (int m = 0; m < M; ++m) {
                qa[m] = pa[m] + (size_t)(kn >> 5) * 16;
                qb[m] = pb[m] + (size_t)(kn >> 5) * 16;
            }
            tc_load<FMT, M, true, FMT == 4>(b, qa, qb, sa, sbr, g, kn, ks,
                                            min(kt, g.in_padded - kn) >> 7);
        }
    }
    // The reduction of tc_block, unchanged.
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

// moe_tc's jobs, arguments, grid and shared memory.
template <int FMT, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, MoeTcF<FMT, SB>::OCC)
moe_tc_f(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs, int ntiles_a_row,
         int ntiles_b_row, int nz, int a_in, int a_in_padded, int a_ld, int a_ngp, int a_gs,
         int a_gs_shift, int b_in, int b_in_padded, int b_ld, int b_ngp, int b_gs,
         int b_gs_shift, int kt) {
    const WGeom ga{a_in, a_in_padded, a_ld, a_ngp, a_gs, a_gs_shift};
    const WGeom gb{b_in, b_in_padded, b_ld, b_ngp, b_gs, b_gs_shift};
    extern __shared__ float4 smem4[];
    float *red = reinterpret_cast<float *>(smem4);
    float *ssc = red + tc_red_floats<SB>();  // fmt 4: the tile's scales, then the staged x
    const int nsc = FMT == 4 ? tc_ssc_floats(a_ngp, b_ngp) : 0;
    unsigned short *xb = reinterpret_cast<unsigned short *>(ssc + nsc);
    moe_queue_la<TC_RG * 16, TC_RG * 16, SB>(
        jobs, ctr, n_jobs, ntiles_a_row, ntiles_b_row, nz, ga, gb,
        TC_KS * MoeTcF<FMT, SB>::UA * 64, TC_KS * MoeTcF<FMT, SB>::UB * 64,
        [&](auto... a) { tc_block_f<FMT, SB, true>(red, xb, kt, ssc, a...); },
        [&](auto... a) { tc_block_f<FMT, SB, false>(red, xb, kt, ssc, a...); });
}
