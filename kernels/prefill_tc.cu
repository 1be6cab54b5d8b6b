// gemv_pf / moe_pf: the int4 products with many activation rows (prefill: matmul with S > 4,
// MLA's value projection and o_proj over many sequences, expert groups) on tensor cores. Same
// jobs as gemv / moe in gemv.cu and gemv_tc / moe_tc in gemv_tc.cu, for fmt 2 and fmt 4 with
// group sizes that are multiples of 16.
//
// Why: at 32 rows an expert group is 154 GFLOP over 604 MB of weights; fp32 FMA needs ~13 ms,
// the weights stream in 135 us. Here every weight is loaded once, dequantized once into an mma
// A fragment, and that fragment meets all 32 activation rows (8 mmas).
//
// Numerics. A (16 weight rows x 16 k) holds the int4 codes as exact bf16 (tc.cuh). Each
// activation row s is split x = hi + lo, hi = bf16(x), lo = bf16(x - hi) (the difference is
// exact in fp32): ~16 significant bits over bf16's exponent range, error ~1e-5 of the result.
// Column 2s of B holds hi, column 2s + 1 lo, so an n=8 tile covers rows 4 nt .. 4 nt + 3 and
// the accumulator pair (c0, c1) of a lane is (hi, lo) of one row: their sum, in fp32, is the
// result. Per-row scales (fmt 2) multiply the final sum; grouped scales (fmt 4) multiply each
// mma's 16-k partial, which lies in one group because gs % 16 == 0.
//
// Fragment mapping: gemv_tc.cu's, on half blocks. A K tile is 512 elements, half of one
// 1024-element int4 block, which is the first or last 8 bytes of every lane chunk (quads 0..3
// or 4..7, common.cuh). Lane (gid = lane / 4, t = lane % 4) loads those 8 bytes of chunk t of
// the 64-byte step st of rows gid and gid + 8: 4 quads, 4 k16 slices, quad q' covering tile
// elements q' * 128 + st * 16 + [0, 16). tc_quad gives a0/a1 = (k0, k2), a2/a3 = (k1, k3); the
// staged column keeps each 4 elements as (k0, k2, k1, k3), so one 8-byte shared load is b0, b1
// and consecutive elements stay consecutive (staging stores and fragment loads are free of
// bank conflicts: columns are PF_CSTRIDE bf16 = 32 bytes apart mod 128).
//
// Work: a block is 8 warps over PF_SROWS activation rows; warp w owns MR 16-row fragments of
// each of M matrices (M = 2: gate and up, silu(gate) * up fused) in row group w % RG, and the
// steps st = ks, ks + KS, ... of every K tile (ks = w / RG). KS = 1: every warp sums its rows
// over all of K and stores from registers; KS > 1 (few rows in all: more, shorter blocks) meets
// in shared memory in a fixed order. Either way the same bits on every call. Two blocks share
// an SM: one stages while the other runs mmas.
#include "cluster.cuh"
#include "common.cuh"
#include "jobs.cuh"
#include "tc.cuh"

#define PF_SROWS 32           // activation rows per block: 64 mma columns (hi, lo)
#define PF_KT 512             // elements per K tile: half an int4 block
#define PF_CSTRIDE (PF_KT + 16)  // bf16 per staged column: 32 bytes apart mod 128 (banks)
#define PF_STAGE_LOADS 4      // float4 loads in flight per thread while staging

// Dynamic shared memory of every prefill block: the staged tile (64 columns), reused by the
// KS > 1 partials at the end.
#define PF_SMEM (2 * PF_SROWS * PF_CSTRIDE * 2)

template <int MR, int KS> struct PfTile {
    static constexpr int RG = GEMV_WARPS / KS;       // row groups
    static constexpr int ROWS = RG * MR * 16;        // weight rows (of each matrix) per block
    static constexpr int NS = 8 / KS;                // steps per warp per K tile
};

// fn(m, f, r) for each of a lane's weight rows: row gid + 8 r of 16-row fragment f of matrix m
// (unrolled, so arrays indexed by m, f, r stay in registers).
template <int M, int MR, class Fn> __device__ __forceinline__ void pf_rows(Fn fn) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int f = 0; f < MR; ++f)
#pragma unroll
            for (int r = 0; r < 2; ++r) fn(m, f, r);
}

// Rows [srow0, srow0 + nrows) of x (float32 [rows, x_stride]; zero past `rows` and past
// in_features) x columns [k0, k0 + PF_KT) -> xb (bf16 bits [2 * nrows][PF_CSTRIDE]): column
// 2s = hi, 2s + 1 = lo. ld.cg: moe's hidden activations were written earlier in the same launch
// by other blocks.
__device__ __forceinline__ void pf_stage(unsigned short *xb, const float *__restrict__ x,
                                         int x_stride, int rows, int srow0, int nrows,
                                         int in_features, int k0) {
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
    const int items = nrows * (PF_KT / 4);
    for (int f0 = threadIdx.x; f0 < items; f0 += blockDim.x * PF_STAGE_LOADS) {
        float4 v[PF_STAGE_LOADS];
#pragma unroll
        for (int j = 0; j < PF_STAGE_LOADS; ++j) {
            const int f = f0 + j * blockDim.x;
            v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            const int s = f / (PF_KT / 4), gi = k0 + (f % (PF_KT / 4)) * 4;
            if (f >= items || srow0 + s >= rows) continue;
            tc_load4(v[j], x + (size_t)(srow0 + s) * x_stride, gi, in_features, vec);
        }
#pragma unroll
        for (int j = 0; j < PF_STAGE_LOADS; ++j) {
            const int f = f0 + j * blockDim.x;
            if (f >= items) break;
            const int s = f / (PF_KT / 4), e = (f % (PF_KT / 4)) * 4;
            unsigned short p[2][4];  // hi, lo
            tc_split<2>(v[j], p);
            unsigned short *d = xb + 2 * s * PF_CSTRIDE + e;
            *reinterpret_cast<uint2 *>(d) = tc_slot(p[0]);
            *reinterpret_cast<uint2 *>(d + PF_CSTRIDE) = tc_slot(p[1]);
        }
    }
}

// Ask L2 for the 512-byte block at byte offset `off` of each of the lane's weight rows (lane t
// takes line t): issued a K tile ahead, so the loads of the next block hit L2.
template <int M, int MR>
__device__ __forceinline__ void pf_prefetch(const unsigned char *const (&pw)[M][MR][2], int off,
                                            int t) {
    pf_rows<M, MR>([&](int m, int f, int r) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(pw[m][f][r] - t * 16 + off + t * 128));
    });
}

// One warp, one staged K tile at element k0, steps ks, ks + KS, ...: acc[m][f][nt] += W x B
// over the first ntv n-tiles (FULL: all 8). pw: the lane's rows (gid, gid + 8 of each fragment)
// at chunk t of byte 0; ps: their scales (fmt 4).
template <int FMT, int M, int MR, int KS, bool FULL>
__device__ __forceinline__ void pf_tile(float (&acc)[M][MR][8][4], const unsigned short *xb,
                                        const unsigned char *const (&pw)[M][MR][2],
                                        const float *const (&ps)[M][MR][2], const WGeom &g,
                                        int k0, int ntv, int ks, int lane) {
    constexpr int NS = PfTile<MR, KS>::NS, QS = FMT == 4 ? 4 : 1;
    const int gid = lane >> 2, t = lane & 3;
    const size_t tile_off = (size_t)(k0 >> 10) * COLI_BLOCK_BYTES + ((k0 >> 9) & 1) * 8;
    const unsigned short *xcol = xb + gid * PF_CSTRIDE + t * 4;
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    uint2 wr[2][M][MR][2];
    auto load = [&](int buf, int st) {
        pf_rows<M, MR>([&](int m, int f, int r) {
            wr[buf][m][f][r] =
                __ldg(reinterpret_cast<const uint2 *>(pw[m][f][r] + tile_off + st * 64));
        });
    };
    load(0, ks);
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int st = ks + i * KS, cur = i & 1;
        if (i + 1 < NS) load(cur ^ 1, st + KS);
        float sr[M][MR][2][QS];  // fmt 4: the scales of each quad's group
        if (FMT == 4)
            pf_rows<M, MR>([&](int m, int f, int r) {
#pragma unroll
                for (int q = 0; q < QS; ++q)
                    sr[m][f][r][q] =
                        __ldg(ps[m][f][r] + coli_group(k0 + q * 128 + st * 16, g.gs, g.gs_shift));
            });
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            unsigned int fa[M][MR][4];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int f = 0; f < MR; ++f) {
                    const uint2 ra = wr[cur][m][f][0], rb = wr[cur][m][f][1];
                    tc_quad(make_uint4(ra.x, ra.y, 0u, 0u), q, fa[m][f][0], fa[m][f][2]);
                    tc_quad(make_uint4(rb.x, rb.y, 0u, 0u), q, fa[m][f][1], fa[m][f][3]);
                }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                if (!FULL && nt >= ntv) continue;
                const uint2 bv =
                    *reinterpret_cast<const uint2 *>(xcol + nt * 8 * PF_CSTRIDE + q * 128 + st * 16);
#pragma unroll
                for (int m = 0; m < M; ++m)
#pragma unroll
                    for (int f = 0; f < MR; ++f) {
                        const unsigned int(&a)[4] = fa[m][f];
                        float(&c)[4] = acc[m][f][nt];
                        if (FMT == 4) {
                            float d[4];
                            tc_mma(d, a[0], a[1], a[2], a[3], bv, zero);
                            const float s0 = sr[m][f][0][q], s1 = sr[m][f][1][q];
                            c[0] = fmaf(s0, d[0], c[0]);
                            c[1] = fmaf(s0, d[1], c[1]);
                            c[2] = fmaf(s1, d[2], c[2]);
                            c[3] = fmaf(s1, d[3], c[3]);
                        } else {
                            tc_mma(c, a[0], a[1], a[2], a[3], bv, c);
                        }
                    }
            }
        }
    }
}

// Weight rows [row0, row0 + PfTile<MR, KS>::ROWS) of one job (of gate and up for DUAL) x
// activation rows [srow0, srow0 + PF_SROWS) over all of K: y[srow, row] = f(sum) (per-row
// scale; DUAL: silu(gate) * up). All threads of the block call it (it has barriers).
// C > 1 (gemv_pf_sk, not DUAL): this block is rank `rank` of a cluster of C and sums K
// [kb, ke) only (whole 1024-element int4 blocks); the C sums of each output meet in
// distributed shared memory in rank order (coli_split_k_out).
template <int FMT, int MR, int KS, bool DUAL, int C = 1>
__device__ __forceinline__ void pf_block(unsigned short *xb, const float *__restrict__ x,
                                         int x_stride, float *__restrict__ y, int y_stride,
                                         int rows, int srow0, int out_rows, int row0,
                                         const unsigned char *w0, const float *sc0,
                                         const unsigned char *w1, const float *sc1,
                                         const WGeom &g, int kb = 0, int ke = 1 << 30,
                                         int rank = 0) {
    static_assert(C == 1 || !DUAL, "split-K blocks (C > 1) compute plain gemv jobs");
    constexpr int M = DUAL ? 2 : 1, RG = PfTile<MR, KS>::RG;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp % RG, ks = warp / RG, gid = lane >> 2, t = lane & 3;
    const int ntv = min(8, (rows - srow0 + 3) >> 2);  // n-tiles holding activation rows
    // Rows past out_rows load row out_rows - 1 (in bounds) and are never written.
    const unsigned char *pw[M][MR][2];
    const float *ps[M][MR][2];
    pf_rows<M, MR>([&](int m, int f, int r) {
        const int row = min(row0 + (rg * MR + f) * 16 + gid + 8 * r, out_rows - 1);
        pw[m][f][r] = (m ? w1 : w0) + (size_t)row * g.ld + t * 16;
        ps[m][f][r] = (m ? sc1 : sc0) + (size_t)row * g.ngp;
    });
    float acc[M][MR][8][4] = {};

    // Tiles past in_features hold only padding (x = 0 there): skipped.
    const int kend = min(ke, g.in_features);
    if (ks == 0 && kb < kend) pf_prefetch<M, MR>(pw, kb / 2, t);
    for (int k0 = kb; k0 < kend; k0 += PF_KT) {
        __syncthreads();  // the previous tile is consumed
        pf_stage(xb, x, x_stride, rows, srow0, 4 * ntv, g.in_features, k0);
        __syncthreads();
        if ((k0 & PF_KT) && ks == 0 && k0 + PF_KT < kend)
            pf_prefetch<M, MR>(pw, (k0 + PF_KT) / 2, t);  // the next int4 block's 512 bytes
        if (ntv == 8)
            pf_tile<FMT, M, MR, KS, true>(acc, xb, pw, ps, g, k0, ntv, ks, lane);
        else
            pf_tile<FMT, M, MR, KS, false>(acc, xb, pw, ps, g, k0, ntv, ks, lane);
    }
    // Lane (gid, t) holds, per fragment f and n-tile nt, activation row 4 nt + t of weight rows
    // gid (c0 + c1: hi + lo) and gid + 8 (c2 + c3).
    constexpr int ROWS = PfTile<MR, KS>::ROWS;
    // C > 1: this block's sum of each output [s][ROWS], past the k-slice partials (KS > 1)
    // or in the staging buffer (KS = 1), for coli_split_k_out.
    float *part = reinterpret_cast<float *>(xb) + (KS > 1 ? KS * RG * M * MR * 16 * PF_SROWS : 0);
    if (KS == 1 && C > 1) {
        __syncthreads();  // the last tile is consumed
#pragma unroll
        for (int f = 0; f < MR; ++f)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (nt < ntv)
                        part[(4 * nt + t) * ROWS + (rg * MR + f) * 16 + gid + 8 * r] =
                            acc[0][f][nt][2 * r] + acc[0][f][nt][2 * r + 1];
        coli_split_k_out<ROWS, PF_SROWS, C, FMT == 2>(part, y, y_stride, rows, srow0, out_rows,
                                                    row0, sc0, rank);
        return;
    }
    if (KS == 1) {
#pragma unroll
        for (int f = 0; f < MR; ++f)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = row0 + (rg * MR + f) * 16 + gid + 8 * r;
                    const int srow = srow0 + 4 * nt + t;
                    if (nt >= ntv || row >= out_rows || srow >= rows) continue;
                    float v[M];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        v[m] = acc[m][f][nt][2 * r] + acc[m][f][nt][2 * r + 1];
                        if (FMT == 2) v[m] *= (m ? sc1 : sc0)[row];
                    }
                    y[(size_t)srow * y_stride + row] = coli_out<DUAL>(v[0], v[M - 1]);
                }
        return;
    }
    // KS > 1: partials [ks][rg][m][f][16 rows][PF_SROWS] in the staging buffer, summed over ks
    // in order.
    constexpr int FR = 16 * PF_SROWS;
    float *red = reinterpret_cast<float *>(xb);
    __syncthreads();  // the last tile is consumed
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int f = 0; f < MR; ++f)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float *p = red + (((ks * RG + rg) * M + m) * MR + f) * FR;
                    p[(gid + 8 * r) * PF_SROWS + 4 * nt + t] =
                        acc[m][f][nt][2 * r] + acc[m][f][nt][2 * r + 1];
                }
    __syncthreads();
    for (int o = threadIdx.x; o < ROWS * PF_SROWS; o += blockDim.x) {
        const int s = o / ROWS, rr = o - s * ROWS;
        const int row = row0 + rr, srow = srow0 + s;
        if (C == 1 && (row >= out_rows || srow >= rows)) continue;
        const int rgo = rr / (MR * 16), f = (rr / 16) % MR, r16 = rr & 15;
        float v[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < KS; ++k)
                sum += red[(((k * RG + rgo) * M + m) * MR + f) * FR + r16 * PF_SROWS + s];
            if (FMT == 2 && C == 1) sum *= (m ? sc1 : sc0)[row];
            v[m] = sum;
        }
        if (C > 1) part[o] = v[0];
        else y[(size_t)srow * y_stride + row] = coli_out<DUAL>(v[0], v[M - 1]);
    }
    if (C > 1)
        coli_split_k_out<ROWS, PF_SROWS, C, FMT == 2>(part, y, y_stride, rows, srow0, out_rows,
                                                    row0, sc0, rank);
}

#define PF_MR 2  // 16-row fragments per warp of gemv and of moe's down tiles

// grid (ceil(max_rows / PF_SROWS), ceil(max_out / PfTile<PF_MR, KS>::ROWS), n_jobs), block
// GEMV_WARPS * 32, dynamic shared PF_SMEM bytes. The blocks of one weight tile run side by side
// (their second reads of the weights hit L2).
template <int FMT, int KS>
__global__ void __launch_bounds__(GEMV_WARPS * 32, FMT == 4 ? 1 : 2)
gemv_pf(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp,
        int gs, int gs_shift) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.z];
    const int row0 = blockIdx.y * PfTile<PF_MR, KS>::ROWS;
    const int srow0 = blockIdx.x * PF_SROWS;
    if (row0 >= job.out_rows || srow0 >= job.rows) return;  // whole block: no barrier skipped
    extern __shared__ float4 smem4[];
    pf_block<FMT, PF_MR, KS, false>(
        reinterpret_cast<unsigned short *>(smem4), reinterpret_cast<const float *>(job.x),
        job.x_stride, reinterpret_cast<float *>(job.y), job.y_stride, job.rows, srow0,
        job.out_rows, row0, reinterpret_cast<const unsigned char *>(job.w0),
        reinterpret_cast<const float *>(job.s0), nullptr, nullptr, g);
}

// gemv_pf's jobs and arguments, K split over a cluster of C blocks (C consecutive blocks in
// x: one cluster, one tile of rows x PF_SROWS activation rows): grid (C * ceil(max_rows /
// PF_SROWS), ceil(max_out / PfTile<PF_MR, KS>::ROWS), n_jobs). Rank r sums the int4 blocks
// [r * N / C, (r + 1) * N / C) of K (N = ceil(in_features / 1024)); where gemv_pf's grid leaves
// SMs idle (o_proj of 8-32 sequences: 24-96 row tiles), C times the blocks stream it. The same
// jobs and numerics as gemv_pf, its sum in another fixed order: the same bits on every call.
template <int FMT, int KS, int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(GEMV_WARPS * 32, FMT == 4 ? 1 : 2)
gemv_pf_sk(const GemvJob *__restrict__ jobs, int in_features, int in_padded, int ld, int ngp,
           int gs, int gs_shift) {
    const WGeom g{in_features, in_padded, ld, ngp, gs, gs_shift};
    const GemvJob job = jobs[blockIdx.z];
    const int row0 = blockIdx.y * PfTile<PF_MR, KS>::ROWS;
    const int srow0 = (blockIdx.x / C) * PF_SROWS;
    // The C blocks of a cluster share blockIdx.x / C, y and z: all leave or none does.
    if (row0 >= job.out_rows || srow0 >= job.rows) return;
    const int rank = (int)coli_cluster_rank(), nb = (in_features + 1023) >> 10;
    extern __shared__ float4 smem4[];
    pf_block<FMT, PF_MR, KS, false, C>(
        reinterpret_cast<unsigned short *>(smem4), reinterpret_cast<const float *>(job.x),
        job.x_stride, reinterpret_cast<float *>(job.y), job.y_stride, job.rows, srow0,
        job.out_rows, row0, reinterpret_cast<const unsigned char *>(job.w0),
        reinterpret_cast<const float *>(job.s0), nullptr, nullptr, g, (rank * nb / C) << 10,
        ((rank + 1) * nb / C) << 10, rank);
}

// A whole expert group in one persistent launch: moe in gemv.cu (the same queue of tiles,
// moe_queue in jobs.cuh, and arguments). Gate+up tiles are PfTile<1, 1>::ROWS hidden rows (gate
// and up in each warp), down tiles PfTile<PF_MR, 1>::ROWS output rows, both x PF_SROWS
// activation rows.
template <int FMT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, FMT == 4 ? 1 : 2)
moe_pf(const MoeJob *__restrict__ jobs, int *ctr, int n_jobs, int ntiles_a_row,
       int ntiles_b_row, int nz, int a_in, int a_in_padded, int a_ld, int a_ngp, int a_gs,
       int a_gs_shift, int b_in, int b_in_padded, int b_ld, int b_ngp, int b_gs,
       int b_gs_shift) {
    const WGeom ga{a_in, a_in_padded, a_ld, a_ngp, a_gs, a_gs_shift};
    const WGeom gb{b_in, b_in_padded, b_ld, b_ngp, b_gs, b_gs_shift};
    extern __shared__ float4 smem4[];
    unsigned short *xb = reinterpret_cast<unsigned short *>(smem4);
    moe_queue<PfTile<1, 1>::ROWS, PfTile<PF_MR, 1>::ROWS, PF_SROWS>(
        jobs, ctr, n_jobs, ntiles_a_row, ntiles_b_row, nz, ga, gb,
        [&](auto... a) { pf_block<FMT, 1, 1, true>(xb, a...); },
        [&](auto... a) { pf_block<FMT, PF_MR, 1, false>(xb, a...); });
}
