// gemv_tc.cu's split-K decode GEMV (gemv_tc_k, gemv_tc_sk): a row tile's K split over the
// blocks of a thread-block cluster. gemv_tc.cu includes this after tc_block and its helpers,
// which it uses (host side: kernels/matmul.py, _gemv_sk).
#pragma once
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
#include "cluster.cuh"

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
    coli_split_k_out<TC_RG * 16, SB, C, FMT == 2>(part, y, job.y_stride, job.rows, srow0,
                                                  out_rows, row0, sc, rank);
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

