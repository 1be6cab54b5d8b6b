// gemv_tc.cu's gemv_st: the int4 decode GEMV (fmt 2, and fmt 4 with power of two group sizes
// 16..256) with its weights streamed by the bulk-copy engine into a ring of shared-memory
// stages, one producer warp feeding 8 or 16 math warps. gemv_tc.cu
// includes this after its helpers, which it uses (host side: kernels/gemv_stream.py, _gemv_st).
#pragma once
// ---- gemv_st: persistent, warp-specialized, weights through cp.async.bulk (STREAM) ----
//
// Why: gemv_tc and its split-K forms load weights into registers, a few 16-byte loads per lane
// between dependent mma chains; ncu puts them at 18-41% of DRAM bandwidth, latency-bound with
// 11-23 warps per SM, and every 32-row tile re-stages its activations between two barriers.
// Here one block per SM (or two: the host's ST_BLOCKS) stays resident for all its tiles:
// - warp MW (the producer) walks the block's tiles and, for each 1024-byte piece of K (512
//   where x leaves less room), asks the bulk-copy engine for the piece of all 16 rows of the
//   tile (16 copies of one row's piece each) into the next free stage of a ring of NS stages,
//   each tracked by a full and an empty mbarrier (the full one counts the bytes landing). NS
//   stages of 16 KB are in flight per SM whatever the math warps do, across tile and job
//   boundaries;
// - warps 0..MW-1 (k slice ks) wait for a stage, take its steps ks, ks + MW, ... (64 bytes of
//   each of the 16 rows per step, 8 quads: one mma.m16n8k16 each, as gemv_tc's tc_compute), release the
//   stage, and at the tile's end meet in shared memory (fixed order);
// - the activations are staged once per block and job (all of K: the host launches gemv_st
//   only where that fits beside the ring), not once per tile; the producer keeps streaming
//   meanwhile.
// DUAL: an expert group's gate and up in one launch, y = silu(gate x) * (up x) (its down is a
// second, plain launch: expert_group.py's streamed groups).
// Work: tiles of 16 output rows x all K, job-major (the activation row groups of SB in z
// order), the block's tiles a contiguous range of them (most blocks stay in one job, so stage
// x once). Rows past out_rows copy row out_rows - 1 (never written).
//
// Numerics as gemv_tc (A: codes as bf16, B: each activation split in three bf16 parts, fp32
// accumulation; per-row scale on the final sum), in another order: each math warp keeps two
// accumulators (even and odd quads: two independent mma chains), and MW k slices meet per row.
// Fixed order everywhere: the same bits on every call, not the same bits as gemv_tc.
// Q8 (fmt 2, and fmt 4 with groups of 32 or more): the same stream with the integer
// tensor-core path as its math (st_stage_q8 below): a quarter (fmt 4: about half) of the bf16
// path's instructions per weight byte, other bits (within the same bound of the float64
// result).
#define ST_ROWS 16
// MW (a template argument, 8 or 16): the math warps, each a k slice; the block has MW + 1
// warps, the last the producer.
// A piece (the bytes of a row per stage) is 1024 bytes (16 steps of 64 bytes), or 512 where the
// staged x leaves room for 3 stages only so (the host's choice: the kernel's pc argument); a
// stage's rows are pc + 64 bytes apart, so rows gid and gid + 1 lie in other banks.
#define ST_PIECE 1024
#define ST_MAX_STAGES 8
#define ST_BARS (16 * ST_MAX_STAGES)  // bytes of the mbarriers before the ring

__device__ __forceinline__ unsigned st_smem(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Bytes of a and b (a: 0..3, b: 4..7) picked by sel's nibbles.
__device__ __forceinline__ unsigned st_prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ void st_bar_init(unsigned long long *b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(st_smem(b)), "r"(count));
}

__device__ __forceinline__ void st_arrive(unsigned long long *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(st_smem(b)) : "memory");
}

__device__ __forceinline__ void st_arrive_tx(unsigned long long *b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(st_smem(b)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void st_wait(unsigned long long *b, unsigned parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "ST_WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra ST_WAIT_%=;\n\t}" ::"r"(st_smem(b)),
        "r"(parity)
        : "memory");
}

// nbytes (a multiple of 16) from global src to shared dst, counted on mbarrier b.
__device__ __forceinline__ void st_copy(void *dst, const void *src, unsigned nbytes,
                                        unsigned long long *b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(st_smem(dst)), "l"(src), "r"(nbytes), "r"(st_smem(b))
        : "memory");
}

// The MW * 32 threads of the math warps (named barrier 1; the producer never waits on it).
template <int MW> __device__ __forceinline__ void st_math_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(MW * 32) : "memory");
}

// Tile `tile` of the launch -> (job, first output row, first activation row); false where the
// job has no such rows (the ragged tail of a job table: skipped alike by every warp).
__device__ __forceinline__ bool st_tile(const GemvJob *__restrict__ jobs, int tile, int ntr,
                                        int nz, int SB, GemvJob &job, int &row0, int &srow0) {
    const int per = ntr * nz, j = tile / per, rem = tile - j * per;
    job = jobs[j];
    row0 = (rem % ntr) * ST_ROWS;
    srow0 = (rem / ntr) * SB;
    return row0 < job.out_rows && srow0 < job.rows;
}

// Grouped scales (FMT 4, gs a power of two in 16..256; the host checks): a stage also holds,
// per weight row, the piece's 2 * pc / gs scales (rows st_scale_stride floats apart: 4 more, so
// the 8 rows a warp reads at once lie in 8 banks), copied beside the row's weights; each mma's
// 16-k partial is multiplied by its group's scale (as gemv_tc's fmt 4).
__host__ __device__ constexpr int st_scale_stride(int pc, int gs) { return 2 * pc / gs + 4; }

// ---- Q8: the integer path ----
//
// Numerics. Each activation row is scaled by a power of two 2^k (from its largest magnitude
// m: m 2^k in [32, 64), exact) and split in four int8 parts, x 2^k = p0 + p1 / 128 + p2 /
// 128^2 + p3 / 128^3 + r: p0 = rint(x 2^k), each later part the rint of 128 times the
// remainder before it (every step exact in fp32, |p| <= 64), |r| <= 2^-22, so x is kept to
// 2^-27 of the row's largest magnitude. The weights enter as their codes c = nibble (0..15)
// on the tensor core's u8 x s8 path: sum (c - 8) p = sum c p - 8 sum p, both exact int32 (the
// column sums of p are counted at staging). A row's four sums are exact integers, combined in
// fp32 from the smallest part up, then scaled by 2^-k and the row's scale. A row with a NaN
// or an infinity gives NaN throughout. Columns 4 s + p of the n=8 tiles (one tile for SB 1,
// two for SB 4).
// Fragments (tc_mma_q8): lane (gid, t) takes word i of its chunk t of a 64-byte step for mma
// i (four per step, 32 k each): a0 = word & 0x0F0F0F0F (nibbles 0, 2, 4, 6 as bytes), a2 =
// (word >> 4) & 0x0F0F0F0F (nibbles 1, 3, 5, 7); a1 / a3 the same of row gid + 8. Nibble n of
// word i of chunk l of block b is element b * 1024 + (2 i + n / 4) * 128 + 4 l + n % 4
// (common.cuh's layout). The staged x holds per column and (step, i, t) 8 bytes, the parts of
// the elements of nibbles 0, 2, 4, 6 and then 1, 3, 5, 7: one 8-byte load gives b0 and b1.
// Columns are cstride bytes apart (in_padded + 32: the 8 columns of a load lie in other banks).
// Fmt 4 (PAIRS): an mma must lie in one group, so it takes quad q of two steps 2 j, 2 j + 1
// (elements b * 1024 + q * 128 + 32 (j % 4) + [0, 32), one group for gs >= 32): the lane's
// 16-bit halves q % 2 of word q / 2 of both chunks, joined by one prmt, then masked as above
// (a0: elements 0, 2 of each step's quad, a2: 1, 3). The staged x holds per (pair, q, t) 8
// bytes: step 2 j's k0, k2, step 2 j + 1's k0, k2, then k1, k3 of each. The -8 offset comes
// from a second mma (A all -8, signed) as the accumulator's start, each mma's int32 sum is
// scaled by its group's scale into an fp32 accumulator.
#define ST_Q8_EXP 5  // a row's largest magnitude is scaled into [2^5, 2^6)

// The accumulators: int32 on the fmt 2 Q8 path (exact to the end), else fp32.
template <bool INT> struct StAcc { using T = float; };
template <> struct StAcc<true> { using T = int; };

// Bytes of the Q8 staging scratch behind the staged x: per math warp and row its largest
// magnitude, per math warp and column its part sums, per column the sums, per row 2^-k.
__host__ __device__ constexpr int st_q8_scratch(int sb, int mw) {
    return 4 * (mw * sb + mw * 4 * sb + 4 * sb + sb);
}

// max(a, b), NaN if either is (fmaxf drops a NaN).
__device__ __forceinline__ float st_nanmax(float a, float b) {
    return fmaxf(a, b) + (a - a) + (b - b);
}

// Rows [srow0, srow0 + SB) of x (float32 [rows, x_stride]), all of K -> xq (int8 parts
// [4 * SB][cstride]), zero past in_features and past `rows`; sig[s] = 2^-k of row s (NaN for a
// row with a NaN or an infinity), qsum[c] = the sum of column c (not PAIRS: fmt 4's order,
// above, whose offset comes from an mma). The MW math warps (named barrier 1) stage; the caller
// syncs before and after.
template <int SB, int MW, bool PAIRS>
__device__ __forceinline__ void st_stage_q8(signed char *xq, int cstride, float *sig, int *qsum,
                                            float *fscr, int *iscr,
                                            const float *__restrict__ x, int x_stride,
                                            int rows, int srow0, int in_features,
                                            int in_padded) {
    constexpr int NTH = MW * 32;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bool vec = ((x_stride & 3) == 0) && ((reinterpret_cast<size_t>(x) & 15) == 0);
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        float m = 0.f, bad = 0.f;  // bad: NaN where a value is not finite (v * 0)
        if (srow0 + s < rows) {
            const float *xr = x + (size_t)(srow0 + s) * x_stride;
            for (int e = tid * 4; e < in_features; e += NTH * 4) {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                tc_load4(v, xr, e, in_features, vec);
                m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
                bad += v.x * 0.f + v.y * 0.f + v.z * 0.f + v.w * 0.f;
            }
        }
        m += bad;
        for (int o = 16; o; o >>= 1) m = st_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) fscr[warp * SB + s] = m;
    }
    st_math_sync<MW>();
    float ia[SB], ib[SB];
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        float m = fscr[s];
        for (int w = 1; w < MW; ++w) m = st_nanmax(m, fscr[w * SB + s]);
        const int ef = (int)((__float_as_uint(m) >> 23) & 0xFF);
        const int k = m > 0.f ? 127 + ST_Q8_EXP - ef : 0;  // NaN, zero: 0
        const int ka = k >> 1, kb = k - ka;  // 2^k in two exact steps (2^k may be no normal)
        ia[s] = __uint_as_float((unsigned)(127 + ka) << 23);
        ib[s] = __uint_as_float((unsigned)(127 + kb) << 23);
        if (tid == 0)
            sig[s] = m != m ? m
                            : __uint_as_float((unsigned)(127 - ka) << 23) *
                                  __uint_as_float((unsigned)(127 - kb) << 23);
    }
    int qs[SB][4];
#pragma unroll
    for (int s = 0; s < SB; ++s) {
        for (int c = 0; c < 4; ++c) qs[s][c] = 0;
        const bool ok = srow0 + s < rows;
        const float *xr = x + (size_t)(srow0 + s) * x_stride;
        for (int e = tid * 4; e < in_padded; e += NTH * 4) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (ok) tc_load4(v, xr, e, in_features, vec);
            const float f[4] = {v.x, v.y, v.z, v.w};
            unsigned int b[4][4];  // [part][k] as bytes
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                float y = f[kk] * ia[s] * ib[s];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float r = rintf(y);
                    const int pi = (int)r;
                    qs[s][c] += pi;
                    b[c][kk] = (unsigned int)pi & 255u;
                    y = (y - r) * 128.f;
                }
            }
            const int r = e & 1023, q = r >> 7, l = (r >> 2) & 31, gst = (e >> 10) * 8 + (l >> 2);
            const int off = PAIRS ? (((gst >> 1) * 8 + q) * 4 + (l & 3)) * 8 + (gst & 1) * 2
                                  : ((gst * 4 + (q >> 1)) * 4 + (l & 3)) * 8 + (q & 1) * 2;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                signed char *d = xq + (size_t)(4 * s + c) * cstride + off;
                *reinterpret_cast<unsigned short *>(d) = (unsigned short)(b[c][0] | b[c][2] << 8);
                *reinterpret_cast<unsigned short *>(d + 4) =
                    (unsigned short)(b[c][1] | b[c][3] << 8);
            }
        }
        if (PAIRS) continue;  // fmt 4 takes its -8 offset from an mma, not from qsum
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            int v = qs[s][c];
            for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) iscr[warp * 4 * SB + 4 * s + c] = v;
        }
    }
    if (PAIRS) return;
    st_math_sync<MW>();
    if (tid < 4 * SB) {
        int v = 0;
        for (int w = 0; w < MW; ++w) v += iscr[w * 4 * SB + tid];
        qsum[tid] = v;
    }
}

// One 64-byte step of a warp on the bf16 path (gemv_tc's numerics): quad q of the lane's
// chunks (wa: row gid, wb: row gid + 8, per matrix) against the staged bf16 parts of global
// step gst (sl: the step within the piece, for fmt 4's group of each mma: ss the stage's scale
// rows of row gid, sst floats apart); even and odd quads in two accumulator chains.
template <int FMT, int M, int NT>
__device__ __forceinline__ void st_bf16_step(float (&acc)[M][2][NT][4], const uint4 (&wa)[M],
                                             const uint4 (&wb)[M],
                                             const unsigned short *const (&xcol)[NT], int gst,
                                             int sl, const float *ss, int sst, int gs_shift) {
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        uint2 bv[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            bv[nt] = *reinterpret_cast<const uint2 *>(xcol[nt] + gst * 128 + q * 16);
        // fmt 4: this mma's group within the piece (elements e0 .. e0 + 15)
        const int gl = (((sl >> 3) * 1024 + q * 128 + (sl & 7) * 16) >> gs_shift);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            unsigned int a0, a1, a2, a3;
            tc_quad(wa[m], q, a0, a2);
            tc_quad(wb[m], q, a1, a3);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float(&c)[4] = acc[m][q & 1][nt];
                if (FMT == 4) {
                    float d[4];
                    tc_mma(d, a0, a1, a2, a3, bv[nt], zero);
                    const float *sm = ss + m * ST_ROWS * sst + gl;
                    const float s0 = sm[0], s1 = sm[8 * sst];
                    c[0] = fmaf(s0, d[0], c[0]);
                    c[1] = fmaf(s0, d[1], c[1]);
                    c[2] = fmaf(s1, d[2], c[2]);
                    c[3] = fmaf(s1, d[3], c[3]);
                } else {
                    tc_mma(c, a0, a1, a2, a3, bv[nt], c);
                }
            }
        }
    }
}

// One 64-byte step of a warp on the Q8 path: mma i of word i of the lane's chunks (wa: row
// gid, wb: row gid + 8, per matrix) against the staged parts of global step gst; even and odd
// mmas in two accumulator chains.
template <int M, int NT>
__device__ __forceinline__ void st_q8_step(int (&acc)[M][2][NT][4], const uint4 (&wa)[M],
                                           const uint4 (&wb)[M],
                                           const signed char *const (&qcol)[NT], int gst) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint2 bv[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            bv[nt] = *reinterpret_cast<const uint2 *>(qcol[nt] + (gst * 4 + i) * 32);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const unsigned int ua[4] = {wa[m].x, wa[m].y, wa[m].z, wa[m].w};
            const unsigned int ub[4] = {wb[m].x, wb[m].y, wb[m].z, wb[m].w};
            const unsigned int a0 = ua[i] & 0x0F0F0F0Fu, a2 = (ua[i] >> 4) & 0x0F0F0F0Fu;
            const unsigned int a1 = ub[i] & 0x0F0F0F0Fu, a3 = (ub[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                tc_mma_q8<false>(acc[m][i & 1][nt], a0, a1, a2, a3, bv[nt],
                                 acc[m][i & 1][nt]);
        }
    }
}

// One pair of 64-byte steps (2 j, 2 j + 1: pa / pb rows gid / gid + 8 of each matrix at the
// two steps) of a warp on the fmt 4 Q8 path: mma q of quad q against the staged parts of pair
// gp; each mma's sum scaled by its group's scale (ss: the stage's scale rows of row gid; gl0:
// the pair's first element within the piece) into the fp32 accumulators.
template <int M, int NT>
__device__ __forceinline__ void st_q8_pair(float (&acc)[M][2][NT][4], const uint4 (&pa)[2][M],
                                           const uint4 (&pb)[2][M],
                                           const signed char *const (&qcol)[NT], int gp,
                                           const float *ss, int sst, int gl0, int gs_shift) {
    const int zero[4] = {0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        uint2 bv[NT];
        int c8[NT][4];  // -8 times each column's sum over the mma's 32 k
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            bv[nt] = *reinterpret_cast<const uint2 *>(qcol[nt] + (gp * 8 + q) * 32);
            tc_mma_q8<true>(c8[nt], 0xF8F8F8F8u, 0xF8F8F8F8u, 0xF8F8F8F8u, 0xF8F8F8F8u, bv[nt],
                            zero);
        }
        const int gl = (gl0 + q * 128) >> gs_shift;
        const unsigned int sel = (q & 1) ? 0x7632u : 0x5410u;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const unsigned int x0[4] = {pa[0][m].x, pa[0][m].y, pa[0][m].z, pa[0][m].w};
            const unsigned int x1[4] = {pa[1][m].x, pa[1][m].y, pa[1][m].z, pa[1][m].w};
            const unsigned int y0[4] = {pb[0][m].x, pb[0][m].y, pb[0][m].z, pb[0][m].w};
            const unsigned int y1[4] = {pb[1][m].x, pb[1][m].y, pb[1][m].z, pb[1][m].w};
            const unsigned int ua = st_prmt(x0[q >> 1], x1[q >> 1], sel);
            const unsigned int ub = st_prmt(y0[q >> 1], y1[q >> 1], sel);
            const unsigned int a0 = ua & 0x0F0F0F0Fu, a2 = (ua >> 4) & 0x0F0F0F0Fu;
            const unsigned int a1 = ub & 0x0F0F0F0Fu, a3 = (ub >> 4) & 0x0F0F0F0Fu;
            const float *sm = ss + m * ST_ROWS * sst + gl;
            const float s0 = sm[0], s1 = sm[8 * sst];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                int d[4];
                tc_mma_q8<false>(d, a0, a1, a2, a3, bv[nt], c8[nt]);
                float(&c)[4] = acc[m][q & 1][nt];
                // int32 -> fp32 exactly (|d| < 2^22) by the 1.5 * 2^23 magic
                c[0] = fmaf(s0, __int_as_float(d[0] + 0x4B400000) - 12582912.f, c[0]);
                c[1] = fmaf(s0, __int_as_float(d[1] + 0x4B400000) - 12582912.f, c[1]);
                c[2] = fmaf(s1, __int_as_float(d[2] + 0x4B400000) - 12582912.f, c[2]);
                c[3] = fmaf(s1, __int_as_float(d[3] + 0x4B400000) - 12582912.f, c[3]);
            }
        }
    }
}

// grid (blocks), block (MW + 1) * 32, dynamic shared ST_BARS + ns * stage + 4 * M * MW * 16 * NCOL
// + 2 * 3 * SB * (in_padded + 16) bytes (Q8: NCOL = 8 * ceil(4 SB / 8), and 4 * SB *
// (in_padded + 32) + st_q8_scratch(SB, MW) for the staged x), stage = M * 16 * (pc + 64 + (FMT
// 4: 4 * st_scale_stride(pc, gs))) (M = 2 for DUAL, else 1; the host's _gemv_st): jobs as gemv_tc's
// (fmt 2 or 4), ntr = ceil(max_out / 16) row tiles and nz = ceil(max_rows / SB) activation
// row groups per job, ns <= ST_MAX_STAGES ring stages of pc-byte pieces (1024 or 512), ngp
// scales per row (fmt 4). DUAL (an expert's gate and up, w0 / s0 and w1 / s1 of each job, one
// weight spec): a stage holds the piece of the tile's 16 gate rows and then its 16 up rows, and
// y = silu(gate x) * (up x).
template <int FMT, int SB, bool DUAL, int MW, bool Q8 = false>
__global__ void __launch_bounds__((MW + 1) * 32, 1)
gemv_st(const GemvJob *__restrict__ jobs, int n_jobs, int ntr, int nz, int in_features,
        int in_padded, int ld, int ngp, int gs, int gs_shift, int ns, int pc) {
    using T = typename StAcc<Q8 && FMT == 2>::T;
    constexpr int NT = Q8 ? (4 * SB + 7) / 8 : TcNT<SB>::value, NCOL = 8 * NT, M = DUAL ? 2 : 1;
    const int rs = pc + 64;  // a stage's weight row stride
    const int sst = FMT == 4 ? st_scale_stride(pc, gs) : 0;  // floats per scale row of a stage
    const int wbytes = M * ST_ROWS * rs, stage = wbytes + M * 4 * ST_ROWS * sst;
    // Shared memory: the mbarriers (full [ns], empty [ns]; ST_BARS bytes), the ring (per
    // stage: M * 16 weight rows, then M * 16 scale rows), the k slices' partials
    // [MW][M][16][NCOL], the staged activations.
    extern __shared__ float4 smem4[];
    unsigned long long *full = reinterpret_cast<unsigned long long *>(smem4);
    unsigned long long *empty = full + ns;
    unsigned char *ring = reinterpret_cast<unsigned char *>(smem4) + ST_BARS;
    T *red = reinterpret_cast<T *>(ring + (size_t)ns * stage);
    unsigned short *xb =
        reinterpret_cast<unsigned short *>(red + MW * M * ST_ROWS * NCOL);
    const int cstride = Q8 ? in_padded + 32 : in_padded + 16;
    // Q8: the int8 parts in place of xb, then the staging scratch.
    signed char *xq = reinterpret_cast<signed char *>(xb);
    float *qsig = reinterpret_cast<float *>(xq + (size_t)4 * SB * cstride);
    int *qsum = reinterpret_cast<int *>(qsig + SB);
    float *fscr = reinterpret_cast<float *>(qsum + 4 * SB);
    int *iscr = reinterpret_cast<int *>(fscr + MW * SB);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < ns; ++i) {
            st_bar_init(full + i, 1);
            st_bar_init(empty + i, MW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n\t"
                     "fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    const int total = n_jobs * ntr * nz;
    const int t0 = (int)((long long)total * blockIdx.x / gridDim.x);
    const int t1 = (int)((long long)total * (blockIdx.x + 1) / gridDim.x);
    const int pieces = (ld + pc - 1) / pc;

    if (warp == MW) {  // the producer: lane l copies stage row l (M * 16 rows)
        int it = 0;
        for (int tile = t0; tile < t1; ++tile) {
            GemvJob job;
            int row0, srow0;
            if (!st_tile(jobs, tile, ntr, nz, SB, job, row0, srow0)) continue;
            const bool up = DUAL && lane >= ST_ROWS;
            const unsigned char *w = reinterpret_cast<const unsigned char *>(up ? job.w1 : job.w0);
            const float *sc = reinterpret_cast<const float *>(up ? job.s1 : job.s0);
            const int row = min(row0 + (lane & 15), job.out_rows - 1);
            for (int p = 0; p < pieces; ++p, ++it) {
                const int slot = it % ns;
                if (it >= ns) st_wait(empty + slot, ((it / ns) - 1) & 1);
                const int kb = p * pc, nb = min(pc, ld - kb);
                const int ns4 = FMT == 4 ? (2 * nb) >> gs_shift : 0;  // the piece's scales
                if (lane == 0) st_arrive_tx(full + slot, M * ST_ROWS * (nb + 4 * ns4));
                __syncwarp();
                if (lane < M * ST_ROWS) {
                    unsigned char *dst = ring + (size_t)slot * stage;
                    st_copy(dst + lane * rs, w + (size_t)row * ld + kb, nb, full + slot);
                    if (FMT == 4)
                        st_copy(dst + wbytes + 4 * lane * sst,
                                sc + (size_t)row * ngp + ((2 * kb) >> gs_shift), 4 * ns4,
                                full + slot);
                }
            }
        }
        return;
    }

    // The math warps.
    const int ks = warp, gid = lane >> 2, t = lane & 3;
    const unsigned short *xcol[TcNT<SB>::value];  // bf16: this lane's column of each n-tile
    tc_cols<SB>(xcol, xb, cstride, lane);
    const signed char *qcol[NT];  // Q8: this lane's column of each n-tile
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) qcol[nt] = xq + min(nt * 8 + gid, 4 * SB - 1) * cstride + t * 8;
    unsigned long long staged_x = ~0ull;  // what xb holds: x, first row, rows
    int staged_s = -1, staged_n = -1;
    int it = 0;
    for (int tile = t0; tile < t1; ++tile) {
        GemvJob job;
        int row0, srow0;
        if (!st_tile(jobs, tile, ntr, nz, SB, job, row0, srow0)) continue;
        if (job.x != staged_x || srow0 != staged_s || job.rows != staged_n) {
            st_math_sync<MW>();  // every math warp is done with the staged x
            if constexpr (Q8)
                st_stage_q8<SB, MW, FMT == 4>(xq, cstride, qsig, qsum, fscr, iscr,
                                    reinterpret_cast<const float *>(job.x), job.x_stride,
                                    job.rows, srow0, in_features, in_padded);
            else
                tc_stage<SB, TC_STAGE_LOADS, MW * 32>(
                    xb, cstride, reinterpret_cast<const float *>(job.x), job.x_stride,
                    job.rows, srow0, in_features, 0, in_padded);
            st_math_sync<MW>();
            staged_x = job.x;
            staged_s = srow0;
            staged_n = job.rows;
        }
        T acc[M][2][NT][4];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[m][h][nt][j] = 0;
        for (int p = 0; p < pieces; ++p, ++it) {
            const int slot = it % ns;
            st_wait(full + slot, (it / ns) & 1);
            const unsigned char *st = ring + (size_t)slot * stage + t * 16;
            const float *ss =
                reinterpret_cast<const float *>(ring + (size_t)slot * stage + wbytes) + gid * sst;
            const int nsteps = min(pc, ld - p * pc) >> 6;
            if constexpr (Q8 && FMT == 4) {  // pairs of steps (nsteps is a multiple of 8)
#pragma unroll
                for (int h = 0; h < (8 + MW - 1) / MW; ++h) {
                    const int pr = ks + MW * h;  // this warp's pair of the stage
                    if (pr >= nsteps >> 1) break;
                    uint4 pa[2][M], pb[2][M];
#pragma unroll
                    for (int u = 0; u < 2; ++u)
#pragma unroll
                        for (int m = 0; m < M; ++m) {
                            const unsigned char *r =
                                st + (m * ST_ROWS + gid) * rs + (2 * pr + u) * 64;
                            pa[u][m] = *reinterpret_cast<const uint4 *>(r);
                            pb[u][m] = *reinterpret_cast<const uint4 *>(r + 8 * rs);
                        }
                    const int sl = 2 * pr;  // the pair's first step within the piece
                    st_q8_pair<M, NT>(acc, pa, pb, qcol, (p * (pc >> 6) + sl) >> 1, ss, sst,
                                      (sl >> 3) * 1024 + (sl & 7) * 16, gs_shift);
                }
            } else {
#pragma unroll
                for (int h = 0; h < 16 / MW; ++h) {
                    const int sl = ks + MW * h;  // this warp's step of the stage
                    if (sl >= nsteps) break;
                    uint4 wa[M], wb[M];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const unsigned char *r = st + (m * ST_ROWS + gid) * rs + sl * 64;
                        wa[m] = *reinterpret_cast<const uint4 *>(r);
                        wb[m] = *reinterpret_cast<const uint4 *>(r + 8 * rs);
                    }
                    const int gst = p * (pc >> 6) + sl;
                    if constexpr (Q8)
                        st_q8_step<M, NT>(acc, wa, wb, qcol, gst);
                    else
                        st_bf16_step<FMT, M, NT>(acc, wa, wb, xcol, gst, sl, ss, sst, gs_shift);
                }
            }
            __syncwarp();
            if (lane == 0) st_arrive(empty + slot);
        }
        // Partials [ks][m][16 rows][NCOL] (c0, c1: row gid; c2, c3: row gid + 8).
        st_math_sync<MW>();  // the previous tile's sums are read
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                T *pr = red + (ks * M + m) * ST_ROWS * NCOL + nt * 8 + 2 * t;
                const T(&a)[4] = acc[m][0][nt], (&b)[4] = acc[m][1][nt];
                pr[gid * NCOL] = a[0] + b[0];
                pr[gid * NCOL + 1] = a[1] + b[1];
                pr[(gid + 8) * NCOL] = a[2] + b[2];
                pr[(gid + 8) * NCOL + 1] = a[3] + b[3];
            }
        st_math_sync<MW>();
        for (int o = threadIdx.x; o < ST_ROWS * SB; o += MW * 32) {
            const int s = o / ST_ROWS, r = o - s * ST_ROWS;
            const int row = row0 + r, srow = srow0 + s;
            if (row >= job.out_rows || srow >= job.rows) continue;
            float v[M];
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float sum = 0.f;
                if constexpr (Q8) {  // part sums (fmt 2: exact ints with the -8 offset), then
                                     // fp32 from the smallest part up
                    T c[4] = {0, 0, 0, 0};
#pragma unroll
                    for (int k = 0; k < MW; ++k) {
                        const T *pr = red + ((k * M + m) * ST_ROWS + r) * NCOL + 4 * s;
#pragma unroll
                        for (int j = 0; j < 4; ++j) c[j] += pr[j];
                    }
#pragma unroll
                    for (int j = 3; j >= 0; --j)
                        sum = sum * 0.0078125f +
                              (FMT == 2 ? (float)(c[j] - 8 * qsum[4 * s + j]) : (float)c[j]);
                    sum *= qsig[s];
                } else {
#pragma unroll
                    for (int k = 0; k < MW; ++k) {
                        const T *pr = red + ((k * M + m) * ST_ROWS + r) * NCOL + 3 * s;
                        sum += (pr[0] + pr[1]) + pr[2];
                    }
                }
                if (FMT == 2) sum *= reinterpret_cast<const float *>(m ? job.s1 : job.s0)[row];
                v[m] = sum;
            }
            reinterpret_cast<float *>(job.y)[(size_t)srow * job.y_stride + row] =
                coli_out<DUAL>(v[0], v[M - 1]);
        }
    }
}
