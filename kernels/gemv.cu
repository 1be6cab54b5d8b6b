// gemv: y[s, o] = sum_i x[s, i] * W[o, i] for a table of jobs in ONE launch (one matmul, the
// heads of an attention's value projection), and moe: a whole expert group in ONE launch.
//
// Decode is memory bound: every weight byte is read once, with 16-byte loads (see common.cuh for
// the layout), while x is staged in shared memory (zero padded, so row padding needs no masks)
// and reused from registers by R output rows per warp and SB activation rows per block. Each
// lane issues a batch of up to 16 independent 16-byte weight loads (and, for grouped scales,
// the scales those chunks need) before it decodes the first: enough bytes in flight per SM to
// keep HBM busy with two or three resident blocks.
//
// Accumulation is fp32, and the order of every sum depends only on the shapes (no atomics in
// any sum): the same call gives the same bits every time, which the async issue path relies on.
#include "common.cuh"
#include "jobs.cuh"
#ifndef COLI_LOADS
#define COLI_LOADS 8  // 16-byte weight loads a lane keeps in flight (halved for grouped scales)
#endif

// Stage rows [srow0, srow0 + SB) x columns [k0, k0 + ktile) of x (float32 [rows, x_stride]) into
// xs [SB][kt], zero past in_features and past `rows`. ld.cg: x may have been written earlier in
// the same launch by another block (moe's hidden activations), so it must not come from L1.
template <int SB>
__device__ __forceinline__ void stage_x(float *xs, int kt, const float *__restrict__ x,
                                        int x_stride, int rows, int srow0, int in_features,
                                        int k0, int ktile) {
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        const bool ok = srow0 + s < rows;
        const float *xr = x + (size_t)(srow0 + s) * x_stride;
        float *dst = xs + s * kt;
        if (vec) {  // k0 and ktile are multiples of 128
            for (int i = threadIdx.x * 4; i < ktile; i += blockDim.x * 4) {
                const int gi = k0 + i;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (ok && gi + 4 <= in_features) {
                    v = __ldcg(reinterpret_cast<const float4 *>(xr + gi));
                } else if (ok && gi < in_features) {
                    v.x = __ldcg(xr + gi);
                    if (gi + 1 < in_features) v.y = __ldcg(xr + gi + 1);
                    if (gi + 2 < in_features) v.z = __ldcg(xr + gi + 2);
                }
                *reinterpret_cast<float4 *>(dst + i) = v;
            }
        } else {
            for (int i = threadIdx.x; i < ktile; i += blockDim.x) {
                const int gi = k0 + i;
                dst[i] = (ok && gi < in_features) ? __ldcg(xr + gi) : 0.f;
            }
        }
    }
}


// One warp: acc{0,1}[s][r] += x[s, k0 : k0 + ktile] . W{0,1}[rows[r], same] (unscaled for the
// per-row formats; grouped scales applied per quad). DUAL reads a second matrix (up) beside w0.
template <int FMT, int R, int SB, bool DUAL>
__device__ __forceinline__ void warp_accum(float (&acc0)[SB][R], float (&acc1)[SB][R],
                                           const float *xs, int kt,
                                           const unsigned char *__restrict__ w0,
                                           const unsigned char *__restrict__ w1,
                                           const float *__restrict__ sc0,
                                           const float *__restrict__ sc1, const int (&rows)[R],
                                           const WGeom &g, int k0, int ktile, int lane) {
    constexpr int QUADS = Fmt<FMT>::QUADS;
    constexpr int BLK = QUADS * 128;
    constexpr int M = DUAL ? 2 : 1;
    // Batch of U chunks per row: U * R * M 16-byte loads in flight per lane (fewer with grouped
    // scales, whose QUADS scale registers per load cost registers too).
    constexpr int LOADS = FMT == 4 ? 4 * COLI_LOADS / 8 : COLI_LOADS;
    constexpr int U = LOADS / (R * M) > 0 ? LOADS / (R * M) : 1;
    constexpr int QS = FMT == 4 ? QUADS : 1;
    const bool quad_scale = FMT == 4 && (g.gs & 3) == 0;
    const int nchunks = ktile / BLK * 32;
    const size_t chunk0 = (size_t)(k0 / BLK) * 32;
    for (int cb = lane; cb < nchunks; cb += 32 * U) {
        uint4 wv4[U][M][R];
        float qsc[U][M][R][QS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = cb + 32 * u;
            if (c < nchunks) {
#pragma unroll
                for (int m = 0; m < M; ++m)
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const size_t off = (size_t)rows[r] * g.ld + (chunk0 + c) * 16;
                        wv4[u][m][r] = __ldg(reinterpret_cast<const uint4 *>((m ? w1 : w0) + off));
                    }
                if (FMT == 4 && quad_scale) {
                    const int gi0 = k0 + (c >> 5) * BLK + lane * 4;
#pragma unroll
                    for (int m = 0; m < M; ++m)
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            const float *srow = (m ? sc1 : sc0) + (size_t)rows[r] * g.ngp;
#pragma unroll
                            for (int q = 0; q < QS; ++q)
                                qsc[u][m][r][q] =
                                    __ldg(srow + coli_group(gi0 + q * 128, g.gs, g.gs_shift));
                        }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = cb + 32 * u;
            if (c >= nchunks) break;
            const int e0 = (c >> 5) * BLK + lane * 4;  // element (in tile) of quad 0
#pragma unroll
            for (int q = 0; q < QUADS; ++q) {
                float4 xv[SB];
#pragma unroll
                for (int s = 0; s < SB; ++s)
                    xv[s] = *reinterpret_cast<const float4 *>(xs + s * kt + e0 + q * 128);
                const int gi = k0 + e0 + q * 128;  // element (in row) of this quad
#pragma unroll
                for (int r = 0; r < R; ++r) {
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float wv[4];
                        decode_quad<FMT>(wv4[u][m][r], q, wv);
                        float qs = 1.f;
                        if (FMT == 4) {
                            if (quad_scale) {
                                qs = qsc[u][m][r][FMT == 4 ? q : 0];
                            } else {
                                const float *srow = (m ? sc1 : sc0) + (size_t)rows[r] * g.ngp;
#pragma unroll
                                for (int k = 0; k < 4; ++k)
                                    wv[k] *= __ldg(srow + coli_group(gi + k, g.gs, g.gs_shift));
                            }
                        }
#pragma unroll
                        for (int s = 0; s < SB; ++s) {
                            float d = wv[0] * xv[s].x;
                            d = fmaf(wv[1], xv[s].y, d);
                            d = fmaf(wv[2], xv[s].z, d);
                            d = fmaf(wv[3], xv[s].w, d);
                            if (m) acc1[s][r] = fmaf(qs, d, acc1[s][r]);
                            else acc0[s][r] = fmaf(qs, d, acc0[s][r]);
                        }
                    }
                }
            }
        }
    }
}

// The warp's rows [wrow, wrow + R) of one job over all K tiles: stage x, accumulate, then write
// y[srow, row] = f(acc) (per-row scale; DUAL: silu(gate) * up). All threads of the block call it
// (it has barriers); warps with no rows in range only help stage.
template <int FMT, int R, int SB, bool DUAL>
__device__ __forceinline__ void block_rows(float *xs, int kt, const float *__restrict__ x,
                                           int x_stride, float *__restrict__ y, int y_stride,
                                           int rows_s, int srow0, int out_rows, int row0,
                                           const unsigned char *w0, const float *sc0,
                                           const unsigned char *w1, const float *sc1,
                                           const WGeom &g) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = row0 + warp * R;
    // Rows past out_rows load row out_rows-1 (in bounds) and are never written.
    int rows_ld[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows_ld[r] = min(wrow + r, out_rows - 1);
    float acc0[SB][R], acc1[SB][R];
#pragma unroll
    for (int s = 0; s < SB; ++s)
#pragma unroll
        for (int r = 0; r < R; ++r) acc0[s][r] = acc1[s][r] = 0.f;

    for (int k0 = 0; k0 < g.in_padded; k0 += kt) {
        const int ktile = min(kt, g.in_padded - k0);
        __syncthreads();  // the previous tile is consumed
        stage_x<SB>(xs, kt, x, x_stride, rows_s, srow0, g.in_features, k0, ktile);
        __syncthreads();
        if (wrow < out_rows)
            warp_accum<FMT, R, SB, DUAL>(acc0, acc1, xs, kt, w0, w1, sc0, sc1, rows_ld, g, k0,
                                         ktile, lane);
    }
    if (wrow >= out_rows) return;
#pragma unroll
    for (int s = 0; s < SB; ++s) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float gv = warp_sum(acc0[s][r]);
            float u = DUAL ? warp_sum(acc1[s][r]) : 0.f;
            const int row = wrow + r, srow = srow0 + s;
            // Lane (s*R + r) % 32 writes this value: the stores spread over lanes.
            if (lane == ((s * R + r) & 31) && row < out_rows && srow < rows_s) {
                if (FMT == 1 || FMT == 2 || FMT == 3) {
                    gv *= sc0[row];
                    if (DUAL) u *= sc1[row];
                }
                y[(size_t)srow * y_stride + row] = coli_out<DUAL>(gv, u);
            }
        }
    }
}

// ---- gemv: a table of independent jobs sharing one weight geometry ---------------------------


// grid (ceil(max_out / (GEMV_WARPS * R)), n_jobs, ceil(max_rows / SB)), block GEMV_WARPS * 32,
// dynamic shared 4 * SB * kt bytes.
template <int FMT, int R, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, SB == 1 ? 2 : 1)
gemv(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp, int gs,
     int gs_shift, int kt) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.y];
    const int row0 = blockIdx.x * (GEMV_WARPS * R);
    const int srow0 = blockIdx.z * SB;
    if (row0 >= job.out_rows || srow0 >= job.rows) return;  // whole block: no barrier skipped
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    block_rows<FMT, R, SB, false>(
        xs, kt, reinterpret_cast<const float *>(job.x), job.x_stride,
        reinterpret_cast<float *>(job.y), job.y_stride, job.rows, srow0, job.out_rows, row0,
        reinterpret_cast<const unsigned char *>(job.w0), reinterpret_cast<const float *>(job.s0),
        nullptr, nullptr, g);
}

// ---- moe: a whole expert group, gate+up and down, in one persistent launch -------------------
//
// The queue of moe_queue (jobs.cuh): phase-A tiles are GEMV_WARPS * MOE_RA hidden rows x SB
// activation rows of one expert, phase-B tiles GEMV_WARPS * MoeRB<FMT, SB>::value output rows.

#define MOE_RA 2
// Down rows per warp: many for decode (short rows: more loads per tile), fewer with more
// activation rows (the accumulators grow with SB * RB).
// Grouped scales take QUADS registers per load: fewer rows there.
template <int FMT, int SB> struct MoeRB {
    static constexpr int value = SB == 1 && FMT != 4 ? 8 : 4;
};


// ctr: int32 [1 + n_jobs], zero at launch (moe_queue). a_*: geometry of gate and up
// (identical), b_*: of down (struct WGeom's fields). grid: resident blocks only (persistent).
template <int FMT, int SB>
__global__ void __launch_bounds__(GEMV_WARPS * 32, SB == 1 ? 2 : 1)
moe(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs, int ntiles_a_row, int ntiles_b_row,
    int nz, int a_in, int a_in_padded, int a_ld, int a_ngp, int a_gs, int a_gs_shift, int b_in,
    int b_in_padded, int b_ld, int b_ngp, int b_gs, int b_gs_shift, int kt) {
    constexpr int RB = MoeRB<FMT, SB>::value;
    const WGeom ga{a_in, a_in_padded, a_ld, a_ngp, a_gs, a_gs_shift};
    const WGeom gb{b_in, b_in_padded, b_ld, b_ngp, b_gs, b_gs_shift};
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    moe_queue<GEMV_WARPS * MOE_RA, GEMV_WARPS * RB, SB>(
        jobs, ctr, n_jobs, ntiles_a_row, ntiles_b_row, nz, ga, gb,
        [&](auto... a) { block_rows<FMT, MOE_RA, SB, true>(xs, kt, a...); },
        [&](auto... a) { block_rows<FMT, RB, SB, false>(xs, kt, a...); });
}
