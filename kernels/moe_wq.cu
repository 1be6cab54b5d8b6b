// moe_wq: the decode expert group (up to R = 1 or 4 activation rows per expert; fmt 2, and
// fmt 4 with power of two group sizes of 32 to 256) with every warp its own work queue client
// and its own copy ring (host side: kernels/matmul.py, MOE_WQ). Its own module: the products
// and activation split of tc.cuh, the job records and geometry of jobs.cuh.
//
// Why: moe_tc / moe_tc_f stage the activations per block tile and meet at block barriers
// twice per tile; ncu puts them at 25-48% of DRAM bandwidth, waiting on loads and barriers
// (bench/results/ncu-2026-12-01.md). Here no barrier spans more than one warp:
// - an item is 16 hidden rows of one expert's gate and up (phase A) or 32 output rows of its
//   down (phase B), over all of K, run by one warp; items are taken with one atomicAdd each,
//   every A item before every B item (jobs.cuh's moe_queue argues why that cannot deadlock);
// - the warp streams its item through a ring of D shared-memory stages with cp.async (S
//   64-byte steps of its 32 weight rows, 512 contiguous bytes per copy instruction's half or
//   quarter warp, plus the S steps' 128 activations of each of its R rows, and for fmt 4 the
//   rows' scales of the stage's 1024-element block), D - 1 stages in flight;
// - each stage's activations are split once (tc_split<3>: hi, mid, lo bf16) into a small
//   per-warp buffer that the fragments read (3 R columns: one n=8 tile at R = 1, two at
//   R = 4); the weights' chunks are read in the fragment order of moe_tc (tc.cuh) from the
//   stage.
//
// Numerics: the same products as moe_tc (int4 codes as exact bf16, activations split three
// ways, fp32 tensor-core sums, (hi + mid) + lo, times the row scale; fmt 4: each stage's
// steps of one quad summed in one mma chain, times their group's scale), summed over K in one
// accumulator per row instead of moe_tc's four k slices: not the same bits as moe_tc, within
// the same ~2^-24 relative per term of float64 (tests/kernels/test_moe_wq.py).
//
// A phase-A item stores h = silu(gate) * up for its 16 rows, fences, and adds one to its
// expert's counter; a phase-B item lets lane 0 spin until the counter holds every A item of
// its expert (ta), then reads h through cp.async.cg (L2: h was written in this launch).
#include "common.cuh"
#include "jobs.cuh"
#include "tc.cuh"

#define WQ_COLS 144  // bf16 per split column of one step: 128 + 16 (conflict-free reads)
#define WQ_PF 512    // bytes per row a waiting B item asks L2 for
// fmt 4: bytes per row of a stage's scales: the 1024 / gs scales of the 1024-element block the
// stage lies in (gs 32 to 256: 128 to 16 bytes), rows 144 bytes apart (the 8 rows a quarter
// warp reads lie in 8 banks).
#define WQ_SCROW 144

template <int FMT, int R, int S, int D> struct MoeWq {
    static constexpr int NT = (3 * R + 7) / 8;             // n=8 tiles of the 3 R columns
    static constexpr int W_BYTES = 2 * 16 * S * 64;        // weights of a stage: 2 x 16 rows
    static constexpr int X_BYTES = R * S * 512;            // activations of a stage (fp32)
    static constexpr int SC_BYTES = FMT == 4 ? 2 * 16 * WQ_SCROW : 0;  // fmt 4: row scales
    static constexpr int STAGE = W_BYTES + X_BYTES + SC_BYTES;
    static constexpr int BD_BYTES = S * 3 * R * WQ_COLS * 2;  // the split activations
    static constexpr int OUT_BYTES = 2 * 16 * 8 * NT * 4;     // an item's sums, at its end
    static constexpr int SMEM = D * STAGE + (BD_BYTES > OUT_BYTES ? BD_BYTES : OUT_BYTES);
    static constexpr int LPR = 4 * S;                      // lanes per row of a copy (16 B each)
    static constexpr int RPI = 32 / LPR;                   // rows per copy instruction
};

// cp.async of 16 bytes into shared memory through L2 (n < 16: the rest zero-filled; 0: none
// read), its commit group, and the wait until at most N of this thread's groups are pending.
__device__ __forceinline__ void wq_cp16(void *dst, const void *src, int n) {
    const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void wq_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wq_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Chunk c (16 bytes) of row r of mat m in a stage's weights: rows of 4S chunks, chunk index
// XOR 4 on odd rows, so that the 8 lanes of a quarter warp (rows gid, gid + 1 at one step)
// read 8 distinct bank groups.
template <int S> __device__ __forceinline__ int wq_chunk(int m, int r, int c) {
    return ((m * 16 + r) * 4 * S + (c ^ ((r & 1) << 2))) * 16;
}

// What an item reads: its two 16-row matrices (w, sc, first rows row0; rows clamped below
// out_rows), their geometry, and its rows activation rows of x (x_stride floats apart).
struct WqSrc {
    const unsigned char *w[2];
    const float *sc[2];
    int row0[2];
    int out_rows;
    const float *x;
    int x_stride, rows;
};

// Issue stage i of an item (its steps [i * S, i * S + S)) into ring slot `slot`: the 32
// weight rows and the activations (fp32, in_features long; zero past it and past rows). One
// commit group per stage (the caller commits).
template <int FMT, int R, int S, int D>
__device__ __forceinline__ void wq_issue(unsigned char *smem, int slot, int i, const WqSrc &a,
                                         const WGeom &g, int lane) {
    using P = MoeWq<FMT, R, S, D>;
    unsigned char *st = smem + slot * P::STAGE;
    const int b0 = i * S * 64;  // byte of each row where the stage starts
#pragma unroll
    for (int j = 0; j < 2 * 16 / P::RPI; ++j) {
        const int m = j / (16 / P::RPI), r = (j % (16 / P::RPI)) * P::RPI + lane / P::LPR;
        const int c = lane % P::LPR;
        const int row = min(a.row0[m] + r, a.out_rows - 1);
        wq_cp16(st + wq_chunk<S>(m, r, c), a.w[m] + (size_t)row * g.ld + b0 + c * 16, 16);
    }
    // Activations: lane (q = lane / 4, t = lane % 4) copies x[base + q * 128 + t * 4, + 4) of
    // each step and row (base: the step's first element), the float4 that fragment (q, t)
    // needs. Only this lane reads it back. An x not 16-byte aligned (never in a call's arena)
    // is loaded and stored here instead.
    const int q = lane >> 2, t = lane & 3;
    const bool al = ((reinterpret_cast<size_t>(a.x) | (size_t)a.x_stride * 4) & 15) == 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float *xr = a.x + (size_t)r * a.x_stride;
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int gst = i * S + s;
            const int gi = (gst >> 3) * 1024 + q * 128 + (gst & 7) * 16 + t * 4;
            const int n = r < a.rows ? max(0, min(16, 4 * (g.in_features - gi))) : 0;
            unsigned char *dst = st + P::W_BYTES + ((r * S + s) * 32 + lane) * 16;
            if (al) {
                wq_cp16(dst, n ? xr + gi : a.x, n);
            } else {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r < a.rows) tc_load4(v, xr, gi, g.in_features, false);
                *reinterpret_cast<float4 *>(dst) = v;
            }
        }
    }
    if (FMT == 4) {  // each row's scales of the stage's block: cpr 16-byte chunks
        const int per = 1024 >> g.gs_shift, cpr = per >> 2, blk = (i * S) >> 3;
        for (int k = lane; k < 32 * cpr; k += 32) {
            const int m = k / (16 * cpr), r = (k / cpr) & 15, c = k % cpr;
            // (m is not known at compile time: selects, not an indexed WqSrc in local memory)
            const int row = min((m ? a.row0[1] : a.row0[0]) + r, a.out_rows - 1);
            const float *src = (m ? a.sc[1] : a.sc[0]) + (size_t)row * g.ngp + blk * per + c * 4;
            unsigned char *dst = st + P::W_BYTES + P::X_BYTES + (m * 16 + r) * WQ_SCROW + c * 16;
            if ((reinterpret_cast<size_t>(src) & 15) == 0) {
                wq_cp16(dst, src, 16);
            } else {  // scales not 16-byte aligned: loaded and stored by this lane
                *reinterpret_cast<float4 *>(dst) =
                    make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
            }
        }
    }
}

// One mma of quad q: weights (wa: row gid, wb: row gid + 8) against n-tile b, into d.
__device__ __forceinline__ void wq_mma(float (&d)[4], const uint4 &wa, const uint4 &wb, int q,
                                       uint2 b, const float (&c)[4]) {
    unsigned int a0, a1, a2, a3;
    tc_quad(wa, q, a0, a2);
    tc_quad(wb, q, a1, a3);
    tc_mma(d, a0, a1, a2, a3, b, c);
}

// One item: acc[m][nt] (C fragments of rows row0[m] + [0, 16), columns 3 r + (hi, mid, lo)
// of activation row r) over all K. fmt 4: every stage lies in one group of each row per quad
// (gs >= 16 S), so its S steps are summed in one mma chain per quad, matrix and n-tile and
// that sum is scaled once.
template <int FMT, int R, int S, int D>
__device__ __forceinline__ void wq_item(float (&acc)[2][MoeWq<FMT, R, S, D>::NT][4],
                                        unsigned char *smem, const WqSrc &a, const WGeom &g,
                                        int lane) {
    using P = MoeWq<FMT, R, S, D>;
    constexpr int NT = P::NT;
    unsigned short *bd = reinterpret_cast<unsigned short *>(smem + D * P::STAGE);
    const int gid = lane >> 2, t = lane & 3;
    const int nstage = (g.in_padded >> 7) / S;
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[m][nt][k] = 0.f;
    // This lane's B column of each n-tile (column 8 nt + gid: beyond 3 R reads zeros).
    int bcol[NT];
    bool bon[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        bcol[nt] = min(8 * nt + gid, 3 * R - 1);
        bon[nt] = 8 * nt + gid < 3 * R;
    }
#pragma unroll
    for (int i = 0; i < D - 1; ++i) {
        if (i < nstage) wq_issue<FMT, R, S, D>(smem, i, i, a, g, lane);
        wq_commit();
    }
    for (int i = 0; i < nstage; ++i) {
        wq_wait<D - 2>();
        __syncwarp();  // every lane's copies of stage i have landed; stage i - 1 is consumed
        const unsigned char *st = smem + (i % D) * P::STAGE;
        // Split this lane's R x S activation quads into the columns the fragments read.
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const float4 v = *reinterpret_cast<const float4 *>(
                    st + P::W_BYTES + ((r * S + s) * 32 + lane) * 16);
                unsigned short p[3][4];
                tc_split<3>(v, p);
#pragma unroll
                for (int c = 0; c < 3; ++c)
                    *reinterpret_cast<uint2 *>(bd + (s * 3 * R + 3 * r + c) * WQ_COLS + gid * 16 +
                                               t * 4) = tc_slot(p[c]);
            }
        __syncwarp();
        {
            const int nx = i + D - 1;  // into the slot of stage i - 1, consumed by every lane
            if (nx < nstage) wq_issue<FMT, R, S, D>(smem, nx % D, nx, a, g, lane);
            wq_commit();
        }
        auto bfrag = [&](int s, int q, int nt) {
            const uint2 b = *reinterpret_cast<const uint2 *>(
                bd + (s * 3 * R + bcol[nt]) * WQ_COLS + q * 16 + t * 4);
            return bon[nt] ? b : make_uint2(0u, 0u);
        };
        if (FMT == 2) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                uint4 wa[2], wb[2];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    wa[m] = *reinterpret_cast<const uint4 *>(st + wq_chunk<S>(m, gid, s * 4 + t));
                    wb[m] = *reinterpret_cast<const uint4 *>(st + wq_chunk<S>(m, gid + 8, s * 4 + t));
                }
#pragma unroll
                for (int q = 0; q < 8; ++q)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint2 b = bfrag(s, q, nt);
#pragma unroll
                        for (int m = 0; m < 2; ++m) wq_mma(acc[m][nt], wa[m], wb[m], q, b, acc[m][nt]);
                    }
            }
        } else {
            uint4 wa[S][2], wb[S][2];
#pragma unroll
            for (int s = 0; s < S; ++s)
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    wa[s][m] = *reinterpret_cast<const uint4 *>(st + wq_chunk<S>(m, gid, s * 4 + t));
                    wb[s][m] = *reinterpret_cast<const uint4 *>(st + wq_chunk<S>(m, gid + 8, s * 4 + t));
                }
            const float *ssc = reinterpret_cast<const float *>(st + P::W_BYTES + P::X_BYTES);
            const int s0 = ((i * S) & 7) * 16;  // the stage's first element in each quad run
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int gi = (q * 128 + s0) >> g.gs_shift;  // group within the block
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float d[2][4];
#pragma unroll
                    for (int s = 0; s < S; ++s) {
                        const uint2 b = bfrag(s, q, nt);
#pragma unroll
                        for (int m = 0; m < 2; ++m) {
                            if (s == 0)
                                wq_mma(d[m], wa[s][m], wb[s][m], q, b, zero);
                            else
                                wq_mma(d[m], wa[s][m], wb[s][m], q, b, d[m]);
                        }
                    }
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const float sa = ssc[(m * 16 + gid) * (WQ_SCROW / 4) + gi];
                        const float sb = ssc[(m * 16 + gid + 8) * (WQ_SCROW / 4) + gi];
                        acc[m][nt][0] = fmaf(sa, d[m][0], acc[m][nt][0]);
                        acc[m][nt][1] = fmaf(sa, d[m][1], acc[m][nt][1]);
                        acc[m][nt][2] = fmaf(sb, d[m][2], acc[m][nt][2]);
                        acc[m][nt][3] = fmaf(sb, d[m][3], acc[m][nt][3]);
                    }
                }
            }
        }
    }
    wq_wait<0>();
    __syncwarp();
    // The sums into shared memory (the split buffer is free): out[m][row][column].
    float *out = reinterpret_cast<float *>(bd);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float *p = out + (m * 16 + gid) * (8 * NT) + 8 * nt + 2 * t;
            p[0] = acc[m][nt][0];
            p[1] = acc[m][nt][1];
            p[8 * 8 * NT] = acc[m][nt][2];
            p[8 * 8 * NT + 1] = acc[m][nt][3];
        }
    __syncwarp();
}

// Row `row` (of 32: matrix row / 16) and activation row r of an item's sums: (hi + mid) + lo.
template <int FMT, int R, int S, int D>
__device__ __forceinline__ float wq_sum(const unsigned char *smem, int row, int r) {
    using P = MoeWq<FMT, R, S, D>;
    const float *p = reinterpret_cast<const float *>(smem + D * P::STAGE) + row * (8 * P::NT) +
                     3 * r;
    return (p[0] + p[1]) + p[2];
}

// The queue: A items (16 hidden rows of gate and up of one job, ta per job), then B items (32
// output rows of down, tb per job); ctr as moe_queue's ([0] tickets, [1 + e] A items of job e
// done). One warp per block; the next ticket is taken one item ahead. x [rows, D], h [rows, ie]
// and y [rows, dout] per job, rows <= R.
template <int FMT, int R, int S, int D>
__global__ void __launch_bounds__(32)
moe_wq(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs, int ta, int tb, int a_in,
       int a_in_padded, int a_ld, int a_ngp, int a_gs, int a_gs_shift, int b_in, int b_in_padded,
       int b_ld, int b_ngp, int b_gs, int b_gs_shift) {
    using P = MoeWq<FMT, R, S, D>;
    extern __shared__ float4 smem4[];
    unsigned char *smem = reinterpret_cast<unsigned char *>(smem4);
    const WGeom ga{a_in, a_in_padded, a_ld, a_ngp, a_gs, a_gs_shift};
    const WGeom gb{b_in, b_in_padded, b_ld, b_ngp, b_gs, b_gs_shift};
    const int lane = threadIdx.x;
    const int total_a = ta * n_jobs, total = total_a + tb * n_jobs;
    int tile = 0;
    if (lane == 0) tile = atomicAdd(ctr, 1);
    tile = __shfl_sync(0xffffffffu, tile, 0);
    while (tile < total) {
        int next = 0;
        if (lane == 0) next = atomicAdd(ctr, 1);
        float acc[2][P::NT][4];
        if (tile < total_a) {
            const int e = tile / ta, row0 = (tile - e * ta) * 16;
            const MoeJob &j = jobs[e];
            const int rows = min(j.rows, R);
            if (row0 < j.ie && rows > 0) {
                const float *sg = reinterpret_cast<const float *>(j.sg);
                const float *su = reinterpret_cast<const float *>(j.su);
                const WqSrc a{{reinterpret_cast<const unsigned char *>(j.wg),
                               reinterpret_cast<const unsigned char *>(j.wu)},
                              {sg, su}, {row0, row0}, j.ie,
                              reinterpret_cast<const float *>(j.x), a_in, rows};
                wq_item<FMT, R, S, D>(acc, smem, a, ga, lane);
                float *h = reinterpret_cast<float *>(j.h);
                for (int o = lane; o < 16 * rows; o += 32) {
                    const int rr = o & 15, r = o >> 4, row = row0 + rr;
                    if (row >= j.ie) continue;
                    float gv = wq_sum<FMT, R, S, D>(smem, rr, r);
                    float uv = wq_sum<FMT, R, S, D>(smem, 16 + rr, r);
                    if (FMT == 2) {
                        gv *= sg[row];
                        uv *= su[row];
                    }
                    h[(size_t)r * j.ie + row] = coli_out<true>(gv, uv);
                }
            }
            __threadfence();  // this lane's h stores are visible device-wide ...
            __syncwarp();     // ... before lane 0 publishes the item
            if (lane == 0) atomicAdd(ctr + 1 + e, 1);
        } else {
            const int tb_i = tile - total_a, e = tb_i / tb, row0 = (tb_i - e * tb) * 32;
            const MoeJob &j = jobs[e];
            const int rows = min(j.rows, R);
            if (row0 < j.dout && rows > 0) {
                const unsigned char *wd = reinterpret_cast<const unsigned char *>(j.wd);
                // Its first WQ_PF bytes of each of its 32 rows asked of L2 before the wait.
                for (int k = lane; k < 32 * (WQ_PF / 128); k += 32) {
                    const int row = min(row0 + k / (WQ_PF / 128), j.dout - 1);
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(
                        wd + (size_t)row * gb.ld + (k % (WQ_PF / 128)) * 128));
                }
                if (lane == 0) {
                    const volatile int *done = ctr + 1 + e;
                    while (*done < ta) __nanosleep(64);
                    __threadfence();
                }
                __syncwarp();
                const float *sd = reinterpret_cast<const float *>(j.sd);
                const WqSrc a{{wd, wd}, {sd, sd}, {row0, row0 + 16}, j.dout,
                              reinterpret_cast<const float *>(j.h), j.ie, rows};
                wq_item<FMT, R, S, D>(acc, smem, a, gb, lane);
                float *y = reinterpret_cast<float *>(j.y);
                for (int o = lane; o < 32 * rows; o += 32) {
                    const int rr = o & 31, r = o >> 5, row = row0 + rr;
                    if (row >= j.dout) continue;
                    const float v = wq_sum<FMT, R, S, D>(smem, rr, r);
                    y[(size_t)r * j.dout + row] = FMT == 2 ? v * sd[row] : v;
                }
            }
        }
        __syncwarp();  // the sums are read before the next item's stages land over them
        tile = __shfl_sync(0xffffffffu, next, 0);
    }
}
