// The MLA flash kernels of attention.cu (mla_flash, mla_flash_c): scores and context on tensor
// cores (split tf32), T slices merged by mla_merge or inside thread-block clusters, and the
// pieces their fp16 form (attention_flash_h.cuh) shares: the slice, the prefetch, the scores'
// and softmax's steps, the tail. attention.cu includes this after KvDesc and mla_merge, which
// it uses (host side: kernels/attention.py).
#pragma once
#include "cluster.cuh"
// ---- mla_flash: all heads of a block share each KV tile, scores and context on tensor cores --
//
// grid (nsplit, S, ceil(H / 64)), block 128 KP (4 KP warps: KP parts of k per head group),
// dynamic shared ``flash_smem`` bytes:
//   Qs  [64][QST]       qfull of the block's 64 heads (zero beyond H and beyond K + R)
//   KVs [FL_TT][KST]    one tile of FL_TT cache rows [latent | rope | zeros], cp.async-filled
//   Ss  [KP][64][FL_TT] partial scores of the KP k parts
// Warp w owns heads 16 * (w & 3) .. + 16 of the block. Scores: warp (w & 3, part = w >> 2)
// takes the k-steps of its part for both 8-row n-tiles; the parts meet in Ss (summed in part
// order). Context: the same warp takes columns [part * 8 * NTC, (part + 1) * 8 * NTC) of the
// latent for all FL_TT rows; the KP warps of a head group compute the same softmax from Ss, so
// they agree on m and l exactly. KP = 2 (8 warps) is the form mla_flash_h shares; KP = 4 (16
// warps, half the k-steps and columns a warp) has twice the warps to hide the mma and shared
// loads' latency with (``attention.FL_KP``).
//
// Numerics: mma.m16n8k8 tf32 with split operands. x = hi + lo, hi = x with the low 13 mantissa
// bits cleared (exactly a tf32), lo = x - hi (exact in fp32, |lo| < 2^-10 |x|, truncated to tf32
// by the tensor core: error < 2^-20 |x|). a * b ~ ah*bh + ah*bl + al*bh: per-product error
// ~2^-20, fp32 accumulation -- the same order as the fp32 FMA kernel (mla_attend).
//
// Fragments (PTX m16n8k8 .tf32, gid = lane / 4, t = lane % 4): A a0 (gid, t), a1 (gid + 8, t),
// a2 (gid, t + 4), a3 (gid + 8, t + 4); B b0 (k t, n gid), b1 (k t + 4, n gid); C c0, c1 (gid,
// 2t, 2t + 1), c2, c3 (gid + 8, 2t, 2t + 1). QST and KST are 4 mod 8 (so 4, 12, 20 or 28 mod
// 32): the A loads and the score B loads hit 32 distinct banks.
#define FL_WARPS 8
#define FL_TT 16
#define FL_HB 64

__device__ __forceinline__ void fl_split(float x, unsigned &hi, unsigned &lo) {
    const unsigned h = __float_as_uint(x) & 0xffffe000u;
    hi = h;
    lo = __float_as_uint(x - __uint_as_float(h));
}

__device__ __forceinline__ void fl_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += a * b with split operands (small terms first).
__device__ __forceinline__ void fl_mma3(float (&d)[4], const unsigned (&ah)[4],
                                        const unsigned (&al)[4], float b0, float b1) {
    unsigned bh0, bl0, bh1, bl1;
    fl_split(b0, bh0, bl0);
    fl_split(b1, bh1, bl1);
    fl_mma(d, al[0], al[1], al[2], al[3], bh0, bh1);
    fl_mma(d, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
    fl_mma(d, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
}

// cp.async of 4 or 16 bytes (n = 0: zero fill, nothing read).
__device__ __forceinline__ void fl_cp4(float *dst, const float *src, int n) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(n));
}

__device__ __forceinline__ void fl_cp16(float *dst, const float *src, int n) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n));
}

// One row of width W (a multiple of 4) into dst: [a (na values) | b (nb values) | zeros].
// VEC: 16-byte copies, for na and nb multiples of 4 and 16-byte aligned a, b and dst; thread
// i of NT (the block) takes chunk i, i + NT, ... of every row of a tile (rows ``rows``, dst
// stride ``ld``).
template <bool VEC, int NT = FL_WARPS * 32>
__device__ __forceinline__ void fl_stage(float *dst, int ld, int rows, int W, const float *a,
                                         int lda, int na, const float *b, int ldb, int nb,
                                         int valid) {
    constexpr int V = VEC ? 4 : 1;
    const int wv = W / V;
    for (int i = threadIdx.x; i < rows * wv; i += NT) {
        const int t = i / wv, c = (i - t * wv) * V;
        const float *src = a;
        int n = 0;
        if (t < valid) {
            if (c < na) {
                src = a + (size_t)t * lda + c;
                n = 4 * V;
            } else if (c < na + nb) {
                src = b + (size_t)t * ldb + (c - na);
                n = 4 * V;
            }
        }
        if (VEC) fl_cp16(dst + t * ld + c, src, n);
        else fl_cp4(dst + t * ld + c, src, n);
    }
}

// Row stride of the context the blocks of a cluster exchange: 8 mod 32 floats, so the float2
// stores of a warp's 8 heads hit distinct banks.
__device__ __forceinline__ int fl_ast(int K) { return ((K + 31) & ~31) + 8; }

// Slice z of nsplit of a sequence's cache (mla_flash, mla_flash_h): its rows [tb, te), chunks of
// whole FL_TT-row tiles (``attention.slice_tiles`` counts them), and where the rows lie.
struct FlSlice {
    const float *lat, *rop;
    int tb, te;
};

__device__ __forceinline__ FlSlice fl_slice(const KvDesc &d, int z, int nsplit) {
    const int chunk = ((d.len + nsplit - 1) / nsplit + FL_TT - 1) / FL_TT * FL_TT;
    const int tb = z * chunk;
    return {reinterpret_cast<const float *>(d.latent), reinterpret_cast<const float *>(d.rope),
            tb, min(d.len, tb + chunk)};
}

// Prefetch the next tile's cache rows (after [t0, t0 + FL_TT), up to te) into L2 (NT threads).
template <int NT = FL_WARPS * 32>
__device__ __forceinline__ void fl_prefetch(const float *lat, const float *rop, int t0, int te,
                                            int K, int R) {
    if (t0 + FL_TT >= te) return;
    const int nr = min(FL_TT, te - t0 - FL_TT);
    const char *a = reinterpret_cast<const char *>(lat + (size_t)(t0 + FL_TT) * K);
    for (int o = threadIdx.x * 128; o < nr * K * 4; o += NT * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a + o));
    const char *b = reinterpret_cast<const char *>(rop + (size_t)(t0 + FL_TT) * R);
    for (int o = threadIdx.x * 128; o < nr * R * 4; o += NT * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(b + o));
}

// A warp's partial scores (C fragments of its two n-tiles, three products each) into Ss at o
// (the row of head gid, column 2 t4; head gid + 8 lies 8 rows below), times fq[i] (heads gid,
// gid + 8) and fk (this lane's columns: rows 2t4, 2t4 + 1, 8 + 2t4, 9 + 2t4 of the tile; 1 for
// mla_flash, 2^-e for mla_flash_h); ADD: added to what o holds.
template <bool ADD>
__device__ __forceinline__ void fl_scores_out(float *o, const float (&slh)[2][4],
                                              const float (&shl)[2][4], const float (&shh)[2][4],
                                              const float (&fq)[2], const float (&fk)[4]) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1, at = nt * 8 + (e & 1) + 8 * FL_TT * i;
            const float v = ((slh[nt][e] + shl[nt][e]) + shh[nt][e]) * fq[i] * fk[2 * nt + (e & 1)];
            o[at] = ADD ? o[at] + v : v;
        }
    }
}

// acc's heads gid (i = 0), gid + 8 (i = 1) times f[i]; nothing where every lane's f is 1 (the
// running max did not move: most tiles past the first few), the same bits either way.
template <int NTC>
__device__ __forceinline__ void fl_rescale(float (&acc)[NTC][4], const float (&f)[2]) {
    if (__all_sync(0xffffffffu, f[0] == 1.f && f[1] == 1.f)) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < NTC; ++j) {
            acc[j][2 * i] *= f[i];
            acc[j][2 * i + 1] *= f[i];
        }
    }
}

// The online softmax of one tile for heads gid, gid + 8 (s: head gid's row of Ss) over this
// lane's tile rows ``rows`` (rows at or past ``valid`` are out): p = e^(score - m), m and l
// carried over; alpha = e^(m_old - m), the factor of the context so far (fl_rescale). A score
// is the KP parts' partials, summed in part order, times scale.
template <int KP = 2>
__device__ __forceinline__ void fl_softmax(float (&p)[2][4], float (&m)[2], float (&l)[2],
                                           float (&alpha)[2], const float *s,
                                           const int (&rows)[4], float scale, int valid) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float *s0 = s + 8 * i * FL_TT;
        float mt = -COLI_INF;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float v = s0[rows[r]];
#pragma unroll
            for (int q = 1; q < KP; ++q) v += s0[q * FL_HB * FL_TT + rows[r]];
            v *= scale;
            p[i][r] = rows[r] < valid ? v : -COLI_INF;
            mt = fmaxf(mt, p[i][r]);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float mn = fmaxf(m[i], mt);  // finite: row t0 < te is in every quad's max
        alpha[i] = expf(m[i] - mn);
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            p[i][r] = expf(p[i][r] - mn);
            sum += p[i][r];
        }
        l[i] = l[i] * alpha[i] + sum;  // this lane's rows only; the quad is summed at the end
        m[i] = mn;
    }
}

// The end of a slice (mla_flash, mla_flash_h): this block's unnormalized context acc (warp
// layout of fl_body, KP parts), running max m and this lane's share of the sum l of its heads
// written as mla_attend's partials (C = 1), or merged over the C slices of its cluster in
// distributed shared memory (Qs and Ss, both free by now, hold what the blocks exchange).
template <int NTC, int C, int KP = 2>
__device__ __forceinline__ void
fl_tail(float (&acc)[NTC][4], const float (&m)[2], float (&l)[2], float *Qs, float *Ss,
        float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
        float *__restrict__ cl, int S, int H, int K, int nsplit) {
    const int z = blockIdx.x, s = blockIdx.y, hb = blockIdx.z * FL_HB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, t4 = lane & 3;
    const int hg = warp & 3, part = warp >> 2;
    constexpr int NT = 128 * KP;

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    if (C == 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int h = hb + hg * 16 + gid + 8 * i;
            if (h >= H) continue;
            const size_t slot = ((size_t)s * H + h) * nsplit + z;
            if (part == 0 && t4 == 0) {
                pm[slot] = m[i];
                pl[slot] = l[i];
            }
#pragma unroll
            for (int j = 0; j < NTC; ++j) {
                const int c = part * 8 * NTC + 8 * j + 2 * t4;
                if (c < K) pacc[slot * K + c] = acc[j][2 * i];
                if (c + 1 < K) pacc[slot * K + c + 1] = acc[j][2 * i + 1];
            }
        }
        return;
    }
    // The C slices of this cluster merged in distributed shared memory: each block leaves its
    // unnormalized context A [64][AST] (in Qs) and its heads' m, l (in Ss); rank r then merges
    // heads [r * 64 / C, (r + 1) * 64 / C) over the C blocks in rank order, with the weights
    // e^(m_q - M) of mla_merge, and writes cl (the cluster is the whole T: nsplit == C) or one
    // partial per cluster for mla_merge (pm, pl, pacc of nsplit / C slices).
    constexpr int HPR = FL_HB / C;
    const int AST = fl_ast(K);
    float *A = Qs, *ML = Ss, *WT = Ss + 2 * FL_HB;  // WT [HPR][C] weights, then M [HPR], L [HPR]
    __syncthreads();  // every warp is done with Qs, KVs and Ss
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int hl = hg * 16 + gid + 8 * i;
        if (part == 0 && t4 == 0) {
            ML[hl] = m[i];
            ML[FL_HB + hl] = l[i];
        }
#pragma unroll
        for (int j = 0; j < NTC; ++j) {
            const int c = part * 8 * NTC + 8 * j + 2 * t4;
            if (c + 1 < K) {
                *reinterpret_cast<float2 *>(A + hl * AST + c) =
                    make_float2(acc[j][2 * i], acc[j][2 * i + 1]);
            } else if (c < K) {
                A[hl * AST + c] = acc[j][2 * i];
            }
        }
    }
    coli_cluster_sync();
    const unsigned rank = static_cast<unsigned>(z % C);
    const int nz = nsplit / C, zc = z / C;
    if (threadIdx.x < HPR) {
        const int hl = rank * HPR + threadIdx.x;
        float mq[C], M = -COLI_INF, L = 0.f;
#pragma unroll
        for (int q = 0; q < C; ++q) {
            mq[q] = coli_dsmem_load(ML + hl, q);
            M = fmaxf(M, mq[q]);
        }
#pragma unroll
        for (int q = 0; q < C; ++q) {
            const float e = M != -COLI_INF ? expf(mq[q] - M) : 0.f;  // empty slices: 0
            WT[threadIdx.x * C + q] = e;
            L = fmaf(coli_dsmem_load(ML + FL_HB + hl, q), e, L);
        }
        WT[HPR * C + threadIdx.x] = M;
        WT[HPR * C + HPR + threadIdx.x] = L;
        const int h = hb + hl;
        if (nz > 1 && h < H) {
            const size_t slot = ((size_t)s * H + h) * nz + zc;
            pm[slot] = M;
            pl[slot] = L;
        }
    }
    __syncthreads();
    if ((K & 3) == 0) {
        const int n4 = K >> 2;
        for (int i = threadIdx.x; i < HPR * n4; i += NT) {
            const int hr = i / n4, c = (i - hr * n4) * 4, hl = rank * HPR + hr, h = hb + hl;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int q = 0; q < C; ++q) {
                const float e = WT[hr * C + q];
                const float4 a = coli_dsmem_load4(A + hl * AST + c, q);
                v.x = fmaf(a.x, e, v.x);
                v.y = fmaf(a.y, e, v.y);
                v.z = fmaf(a.z, e, v.z);
                v.w = fmaf(a.w, e, v.w);
            }
            if (h >= H) continue;
            if (nz == 1) {
                const float L = WT[HPR * C + HPR + hr], inv = L > 0.f ? 1.f / L : 0.f;
                *reinterpret_cast<float4 *>(cl + ((size_t)h * S + s) * K + c) =
                    make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
            } else {
                *reinterpret_cast<float4 *>(pacc + (((size_t)s * H + h) * nz + zc) * K + c) = v;
            }
        }
    } else {
        for (int i = threadIdx.x; i < HPR * K; i += NT) {
            const int hr = i / K, c = i - hr * K, hl = rank * HPR + hr, h = hb + hl;
            float v = 0.f;
#pragma unroll
            for (int q = 0; q < C; ++q) v = fmaf(coli_dsmem_load(A + hl * AST + c, q), WT[hr * C + q], v);
            if (h >= H) continue;
            if (nz == 1) {
                const float L = WT[HPR * C + HPR + hr];
                cl[((size_t)h * S + s) * K + c] = v * (L > 0.f ? 1.f / L : 0.f);
            } else {
                pacc[(((size_t)s * H + h) * nz + zc) * K + c] = v;
            }
        }
    }
    coli_cluster_wait_exit();  // no block leaves while another reads its shared memory
}

// NTC: 8-column n-tiles of the latent per warp (KP * 8 * NTC >= K). QST, KST: row strides of Qs
// and KVs (>= the padded K + R, >= 8 KP NTC, 4 mod 8). Outputs as mla_attend's (C = 1), or
// merged over the C slices of a cluster (``mla_flash_c``).
template <int NTC, int C, int KP>
__device__ __forceinline__ void
fl_body(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
        const float *__restrict__ qfull, const KvDesc *__restrict__ kv, float *__restrict__ cl,
        int S, int H, int K, int R, float scale, int nsplit, int QST, int KST) {
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4);
    float *KVs = Qs + FL_HB * QST;
    float *Ss = KVs + FL_TT * KST;
    const int z = blockIdx.x, s = blockIdx.y, hb = blockIdx.z * FL_HB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, t4 = lane & 3;
    const int hg = warp & 3, part = warp >> 2;
    constexpr int NT = 128 * KP;
    const FlSlice sl = fl_slice(kv[s], z, nsplit);
    const float *__restrict__ lat = sl.lat;
    const float *__restrict__ rop = sl.rop;
    const int tb = sl.tb, te = sl.te;
    const int KR = K + R, KRP = (KR + 7) & ~7, W = KST - 4;

    // Q of the block's heads, in flight with the first tile (both waited for in the loop).
    // 16-byte copies where every row starts 16-byte aligned (K and R multiples of 4).
    const bool vec = ((K | R) & 3) == 0;
    const float *qrow = qfull + ((size_t)s * H + hb) * KR;
    if (vec) fl_stage<true, NT>(Qs, QST, FL_HB, KRP, qrow, KR, KR, qrow, 0, 0, H - hb);
    else fl_stage<false, NT>(Qs, QST, FL_HB, KRP, qrow, KR, KR, qrow, 0, 0, H - hb);

    float acc[NTC][4];
#pragma unroll
    for (int j = 0; j < NTC; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m[2] = {-COLI_INF, -COLI_INF}, l[2] = {0.f, 0.f};
    const int nks = KRP / 8, ks0 = part * nks / KP, ks1 = (part + 1) * nks / KP;
    const float *qa = Qs + (hg * 16 + gid) * QST + t4;

    for (int t0 = tb; t0 < te; t0 += FL_TT) {
        __syncthreads();  // every warp is done with the previous tile (and Ss)
        const float *la = lat + (size_t)t0 * K, *ro = rop + (size_t)t0 * R;
        if (vec) fl_stage<true, NT>(KVs, KST, FL_TT, W, la, K, K, ro, R, R, te - t0);
        else fl_stage<false, NT>(KVs, KST, FL_TT, W, la, K, K, ro, R, R, te - t0);
        asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        fl_prefetch<NT>(lat, rop, t0, te, K, R);  // the next tile into L2 meanwhile

        // Scores of heads hg, rows 0..15, k-steps [ks0, ks1). The three products of the split
        // operands accumulate apart, six independent mma chains: one chain per n-tile would
        // wait out the mma latency three times per k-step.
        float shh[2][4] = {}, shl[2][4] = {}, slh[2][4] = {};
#pragma unroll 4
        for (int ks = ks0; ks < ks1; ++ks) {
            const int k0 = ks * 8;
            unsigned ah[4], al[4];
            fl_split(qa[k0], ah[0], al[0]);
            fl_split(qa[8 * QST + k0], ah[1], al[1]);
            fl_split(qa[k0 + 4], ah[2], al[2]);
            fl_split(qa[8 * QST + k0 + 4], ah[3], al[3]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float *kb = KVs + (nt * 8 + gid) * KST + k0 + t4;
                unsigned bh0, bl0, bh1, bl1;
                fl_split(kb[0], bh0, bl0);
                fl_split(kb[4], bh1, bl1);
                fl_mma(slh[nt], al[0], al[1], al[2], al[3], bh0, bh1);
                fl_mma(shl[nt], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
                fl_mma(shh[nt], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
            }
        }
        {
            const float one2[2] = {1.f, 1.f}, one4[4] = {1.f, 1.f, 1.f, 1.f};
            fl_scores_out<false>(Ss + (part * FL_HB + hg * 16 + gid) * FL_TT + 2 * t4, slh, shl,
                                 shh, one2, one4);
        }
        __syncthreads();

        // Online softmax: this lane's rows t4, t4 + 4, 8 + t4, 12 + t4 of heads gid, gid + 8.
        float p[2][4];
        {
            const int rows[4] = {t4, t4 + 4, 8 + t4, 12 + t4};
            float alpha[2];
            fl_softmax<KP>(p, m, l, alpha, Ss + (hg * 16 + gid) * FL_TT, rows, scale, te - t0);
            fl_rescale(acc, alpha);
        }
        // Context: acc[heads, cols] += P[heads, rows] @ latent[rows, cols].
        const int cb = part * 8 * NTC + gid;
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            unsigned ah[4], al[4];
            fl_split(p[0][2 * kk], ah[0], al[0]);
            fl_split(p[1][2 * kk], ah[1], al[1]);
            fl_split(p[0][2 * kk + 1], ah[2], al[2]);
            fl_split(p[1][2 * kk + 1], ah[3], al[3]);
            const float *lb = KVs + (kk * 8 + t4) * KST + cb;
#pragma unroll
            for (int j = 0; j < NTC; ++j) fl_mma3(acc[j], ah, al, lb[8 * j], lb[4 * KST + 8 * j]);
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // a slice without rows still staged Q
    fl_tail<NTC, C, KP>(acc, m, l, Qs, Ss, pm, pl, pacc, cl, S, H, K, nsplit);
}

// Slices as ``nsplit`` blocks in x, partials for mla_merge (cl unused). Block 128 KP.
template <int NTC, int KP>
__global__ void __launch_bounds__(128 * KP, 1)
mla_flash(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
          const float *__restrict__ qfull, const KvDesc *__restrict__ kv, float *__restrict__ cl,
          int S, int H, int K, int R, float scale, int nsplit, int QST, int KST) {
    fl_body<NTC, 1, KP>(pm, pl, pacc, qfull, kv, cl, S, H, K, R, scale, nsplit, QST, KST);
}

// Clusters of C consecutive slices (nsplit a multiple of C) merged in DSMEM: cl [H, S, K] when
// nsplit == C (no mla_merge), else pm, pl, pacc of nsplit / C slices. Shared memory as
// mla_flash's, and at least 64 * fl_ast(K) floats in Qs + KVs for the exchanged context.
template <int NTC, int C, int KP>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(128 * KP, 1)
mla_flash_c(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
            const float *__restrict__ qfull, const KvDesc *__restrict__ kv,
            float *__restrict__ cl, int S, int H, int K, int R, float scale, int nsplit, int QST,
            int KST) {
    fl_body<NTC, C, KP>(pm, pl, pacc, qfull, kv, cl, S, H, K, R, scale, nsplit, QST, KST);
}
