// gemv_tc.cu's moe_tc_f: the decode expert group with its loads issued ahead, the same bits as
// moe_tc. gemv_tc.cu includes this after moe_tc and its helpers, which it uses (host side:
// kernels/matmul.py, MOE_TC_FAST).
#pragma once
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
