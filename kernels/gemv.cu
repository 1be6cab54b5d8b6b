// gemv: y[s, o] = sum_i x[s, i] * W[o, i] for a table of jobs in ONE launch (one matmul, all the
// experts of a group, all the heads of an attention's value projection).
//
// Decode is memory bound: every weight byte is read once, with 16-byte loads (see common.cuh for
// the layout), while x is staged in shared memory (zero padded, so row padding needs no masks)
// and reused from registers by R output rows per warp and SB activation rows per block. DUAL
// reads the gate and up rows of an expert side by side and writes silu(gate x) * (up x), so the
// hidden activation of an expert is one launch and never exists unfused.
//
// Accumulation is fp32, and the order of every sum depends only on the shapes (no atomics):
// the same call gives the same bits every time, which the async issue path relies on.
#include "common.cuh"

struct GemvJob {
    unsigned long long w0, s0;  // weights (resident layout) and scales of the (gate) matrix
    unsigned long long w1, s1;  // up matrix for DUAL, else unused
    unsigned long long x, y;    // float32 activations in [rows, x_stride], out [rows, y_stride]
    int rows;                   // activation rows of this job
    int out_rows;               // O of this job (rows of W it uses, from w0)
    int x_stride, y_stride;     // in elements
};

#define GEMV_WARPS 8

template <int FMT, int R, int SB, bool DUAL>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp, int gs,
     int gs_shift, int kt) {
    constexpr int QUADS = Fmt<FMT>::QUADS;
    constexpr int BLK = QUADS * 128;
    const GemvJob job = jobs[blockIdx.y];
    const int row0 = blockIdx.x * (GEMV_WARPS * R);
    const int srow0 = blockIdx.z * SB;
    if (row0 >= job.out_rows || srow0 >= job.rows) return;  // whole block: no barrier skipped

    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);  // [SB][kt]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = row0 + warp * R;
    const float *__restrict__ x = reinterpret_cast<const float *>(job.x);
    const unsigned char *__restrict__ w0 = reinterpret_cast<const unsigned char *>(job.w0);
    const unsigned char *__restrict__ w1 = reinterpret_cast<const unsigned char *>(job.w1);
    const float *__restrict__ sc0 = reinterpret_cast<const float *>(job.s0);
    const float *__restrict__ sc1 = reinterpret_cast<const float *>(job.s1);

    // Rows past out_rows load row out_rows-1 (in bounds) and are never written.
    int rows_ld[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows_ld[r] = min(wrow + r, job.out_rows - 1);

    float acc0[SB][R], acc1[SB][R];
#pragma unroll
    for (int s = 0; s < SB; ++s)
#pragma unroll
        for (int r = 0; r < R; ++r) acc0[s][r] = acc1[s][r] = 0.f;

    const bool quad_scale = (gs & 3) == 0;
    for (int k0 = 0; k0 < in_padded; k0 += kt) {
        const int ktile = min(kt, in_padded - k0);
        __syncthreads();  // the previous tile is consumed
#pragma unroll
        for (int s = 0; s < SB; ++s) {
            const bool srow_ok = srow0 + s < job.rows;
            const float *xr = x + (size_t)(srow0 + s) * job.x_stride;
            for (int i = threadIdx.x; i < ktile; i += blockDim.x) {
                const int gi = k0 + i;
                xs[s * kt + i] = (srow_ok && gi < in_features) ? xr[gi] : 0.f;
            }
        }
        __syncthreads();
        if (wrow < job.out_rows) {
            const int nchunks = ktile / BLK * 32;
            const size_t chunk0 = (size_t)(k0 / BLK) * 32;
            for (int c = lane; c < nchunks; c += 32) {
                const int e0 = (c >> 5) * BLK + lane * 4;  // element (in tile) of quad 0
                uint4 a[R], b[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const size_t off = (size_t)rows_ld[r] * ld + (chunk0 + c) * 16;
                    a[r] = __ldg(reinterpret_cast<const uint4 *>(w0 + off));
                    if (DUAL) b[r] = __ldg(reinterpret_cast<const uint4 *>(w1 + off));
                }
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
                        for (int m = 0; m < (DUAL ? 2 : 1); ++m) {
                            float wv[4];
                            decode_quad<FMT>(m ? b[r] : a[r], q, wv);
                            float qs = 1.f;
                            if (FMT == 4) {
                                const float *srow = (m ? sc1 : sc0) + (size_t)rows_ld[r] * ngp;
                                if (quad_scale) {
                                    qs = __ldg(srow + coli_group(gi, gs, gs_shift));
                                } else {
#pragma unroll
                                    for (int k = 0; k < 4; ++k)
                                        wv[k] *= __ldg(srow + coli_group(gi + k, gs, gs_shift));
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
    if (wrow >= job.out_rows) return;

    float *__restrict__ y = reinterpret_cast<float *>(job.y);
#pragma unroll
    for (int s = 0; s < SB; ++s) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float g = warp_sum(acc0[s][r]);
            float u = DUAL ? warp_sum(acc1[s][r]) : 0.f;
            const int row = wrow + r, srow = srow0 + s;
            // Lane (s*R + r) % 32 writes this value: the stores spread over lanes.
            if (lane == ((s * R + r) & 31) && row < job.out_rows && srow < job.rows) {
                if (FMT == 1 || FMT == 2 || FMT == 3) {
                    g *= sc0[row];
                    if (DUAL) u *= sc1[row];
                }
                float out = g;
                if (DUAL) out = g / (1.f + expf(-g)) * u;  // silu(gate) * up
                y[(size_t)srow * job.y_stride + row] = out;
            }
        }
    }
}
