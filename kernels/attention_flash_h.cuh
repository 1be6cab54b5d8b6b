// The fp16 form of attention.cu's flash kernels (mla_flash_h, mla_flash_hc) and mla_qsplit,
// which splits their q rows once per call. attention.cu includes this after attention_flash.cuh,
// whose slice, prefetch, scores' and softmax's steps and tail it uses (host side:
// kernels/attention.py, ``FL_F16``).
#pragma once
// ---- mla_flash_h: mla_flash's tiles on fp16 tensor cores, every operand split once ----------
//
// The same grid, block, warp roles, softmax and tail (fl_tail) as mla_flash; what differs is
// how the operands reach the tensor cores. Dynamic shared memory (``flash_h_smem`` bytes):
//   Qh [2][64][QSTH]     fp16: the block's q rows, hi plane then lo plane
//   Kh [2][FL_TT][KSTH]  fp16: one tile of cache rows [latent | rope | zeros], hi then lo
//   Ss [2][64][FL_TT]    fp32: partial scores of the two k halves (as mla_flash's)
//   QE [64][2], TE [FL_TT][2]  int: the exponents (latent, rope) of the q rows and the tile's
// QSTH and KSTH are 8 mod 16 (rows of 4 mod 8 words: the ldmatrix rows of a phase hit distinct
// banks) and hold >= the padded K + R (KSTH also >= 16 NTC); every row starts 16-byte aligned.
//
// Numerics. Each segment x of a row (its latent, its rope; of a q row once per call, of a cache
// row per tile) is scaled by 2^e, its power of two with max |x| 2^e in [2^14, 2^15) (e <= 100:
// all zero), and split once into hi = fp16(x 2^e) and lo = fp16(x 2^e - hi), both rounded to
// nearest: 22 significant bits (a relative error below 2^-22, against 2^-20 for mla_flash's
// tf32 parts) for every value down to 2^-17 of its segment's largest; below that lo is
// subnormal (an absolute error under 2^-39 of the largest). mma.m16n8k16 multiplies
// fp16 exactly and adds in fp32; a score is (ql kh + qh kl + qh kh) 2^-e_q 2^-e_t over the
// latent's steps plus the same over the rope's, each with its segments' exponents (e_t below is
// a cache row's latent exponent). acc holds the context times 2^c, c = 14 + E
// of the slice's first tile (E: the smallest e_t of a tile, its largest row), then the least
// 14 + E so far (acc shifted down with the softmax's rescale); the context's A operand is
// p 2^(c - e_t) (at most 2^14), split the same way, so the products land in acc's units and the
// rows meet at the largest row's scale so far: a row more than 2^30 below it keeps only what
// lies above 2^-24 of that scale. acc times 2^-c at the end.
//
// Fragments (PTX m16n8k16 .f16, gid = lane / 4, t = lane % 4): A a0 (gid, 2t..2t+1), a1 (gid +
// 8, ..), a2 (gid, 2t+8..2t+9), a3 (gid + 8, ..); B b0 (k 2t..2t+1, n gid), b1 (k 2t+8.., n
// gid); C as m16n8k8's. A staged row is [latent (K) | zeros to KP = K rounded up to 16 | rope
// (R) | zeros to KRP = KP + R rounded up to 16]: no k16 step holds both segments. q and K
// tiles are read by ldmatrix.x4 (four 8x8 blocks), the latent as B of the context by
// ldmatrix.x4.trans (its rows are k). A lane's softmax rows are the tile rows 2t, 2t+1, 2t+8,
// 2t+9: those of its A fragment of P.
#define FH_MQ 5  // value quads per lane of a staged row: rows up to 128 * FH_MQ values

// e with max |x| 2^e in [2^14, 2^15) for m = max |x|, at most 100 (m = 0 or subnormal: 100;
// m = inf: -114).
__device__ __forceinline__ int fh_exp(float m) {
    const int ex = static_cast<int>((__float_as_uint(m) >> 23) & 255u);
    return ex == 0 ? 100 : min(141 - ex, 100);
}

// 2^e, e in [-126, 127].
__device__ __forceinline__ float fh_pow2(int e) {
    return __uint_as_float(static_cast<unsigned>(e + 127) << 23);
}

// hi = (fp16(a), fp16(b)), lo = (fp16(a - hi.a), fp16(b - hi.b)): a in the low half. Two
// packed conversions to fp16 (cvt.rn.f16x2.f32), two back.
__device__ __forceinline__ void fh_split2(float a, float b, unsigned &hi, unsigned &lo) {
    asm("{\n\t.reg .b16 ha, hb;\n\t.reg .f32 fa, fb;\n\t"
        "cvt.rn.f16x2.f32 %0, %3, %2;\n\tmov.b32 {ha, hb}, %0;\n\t"
        "cvt.f32.f16 fa, ha;\n\tcvt.f32.f16 fb, hb;\n\t"
        "sub.f32 fa, %2, fa;\n\tsub.f32 fb, %3, fb;\n\t"
        "cvt.rn.f16x2.f32 %1, fb, fa;\n\t}"
        : "=r"(hi), "=r"(lo)
        : "f"(a), "f"(b));
}

__device__ __forceinline__ void fh_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix: four 8x8 fp16 blocks, lanes 8i..8i+7 giving the row addresses of block i; r[i]
// holds this lane's pair of block i (row lane / 4, columns 2 (lane % 4)..; transposed: column
// lane / 4, rows 2 (lane % 4)..).
__device__ __forceinline__ void fh_ldsm4(unsigned (&r)[4], const unsigned short *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fh_ldsm4t(unsigned (&r)[4], const unsigned short *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fh_ldsm2t(unsigned (&r)[4], const unsigned short *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}

// *p, through the read-only path (__ldg) with NC.
template <bool NC, class T> __device__ __forceinline__ T fh_ld(const T *p) {
    if (NC) return __ldg(p);
    return *p;
}

// Rows staged by one warp, NR at a time (their loads in flight together): row i is [a[i] (na[i]
// values) | zeros | b[i] (nb[i] values, from column ``cut``, a multiple of 16 >= na[i]) |
// zeros] up to W (a multiple of 4, at most 128 FH_MQ), each segment scaled by its own power of
// two, 2^e[i][0] for a's, 2^e[i][1] for b's (their fh_exp), and split into the planes hi[i],
// lo[i] (words: value pairs). Lane l takes the quads 4 (l + 32 j). VEC: float4 loads (na, nb
// multiples of 4, a and b 16-byte aligned); every load is predicated, none branches. NC: loads
// through the read-only path (__ldg), for rows no thread of the kernel writes; else plain loads.
template <bool VEC, int NR, bool NC = true>
__device__ __forceinline__ void fh_rows(unsigned *const (&hi)[NR], unsigned *const (&lo)[NR],
                                        const float *const (&a)[NR], const int (&na)[NR],
                                        const float *const (&b)[NR], const int (&nb)[NR], int W,
                                        int cut, int lane, int (&e)[NR][2]) {
    float4 v[NR][FH_MQ];
    float mx[NR][2];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        mx[r][0] = mx[r][1] = 0.f;
#pragma unroll
        for (int j = 0; j < FH_MQ; ++j) {
            const int c = 4 * (lane + 32 * j);
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (VEC) {
                const float *src = c < cut ? a[r] + c : b[r] + (c - cut);
                if (c < na[r] || (c >= cut && c - cut < nb[r]))
                    x = fh_ld<NC>(reinterpret_cast<const float4 *>(src));
                const float m4 =
                    fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
                if (c < cut) mx[r][0] = fmaxf(mx[r][0], m4);  // quads do not straddle (VEC)
                else mx[r][1] = fmaxf(mx[r][1], m4);
            } else {
                float t[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int ck = c + k;
                    const float *src = ck < cut ? a[r] + ck : b[r] + (ck - cut);
                    t[k] = ck < na[r] || (ck >= cut && ck - cut < nb[r]) ? fh_ld<NC>(src) : 0.f;
                    if (ck < cut) mx[r][0] = fmaxf(mx[r][0], fabsf(t[k]));
                    else mx[r][1] = fmaxf(mx[r][1], fabsf(t[k]));
                }
                x = make_float4(t[0], t[1], t[2], t[3]);
            }
            v[r][j] = x;
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            mx[r][0] = fmaxf(mx[r][0], __shfl_xor_sync(0xffffffffu, mx[r][0], o));
            mx[r][1] = fmaxf(mx[r][1], __shfl_xor_sync(0xffffffffu, mx[r][1], o));
        }
        e[r][0] = fh_exp(mx[r][0]);
        e[r][1] = fh_exp(mx[r][1]);
        const float f0 = fh_pow2(e[r][0]), f1 = fh_pow2(e[r][1]);
#pragma unroll
        for (int j = 0; j < FH_MQ; ++j) {
            const int c = 4 * (lane + 32 * j);
            if (c >= W) continue;
            float f[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) f[k] = c + k < cut ? f0 : f1;
            unsigned h0, l0, h1, l1;
            fh_split2(v[r][j].x * f[0], v[r][j].y * f[1], h0, l0);
            fh_split2(v[r][j].z * f[2], v[r][j].w * f[3], h1, l1);
            *reinterpret_cast<uint2 *>(hi[r] + (c >> 1)) = make_uint2(h0, h1);
            *reinterpret_cast<uint2 *>(lo[r] + (c >> 1)) = make_uint2(l0, l1);
        }
    }
}

// A warp's scores of 16 heads x 16 tile rows over the k16 steps [k0, k1) (ldmatrix rows qa of
// q, kb of the tile; the lo planes FL_HB * QSTH and FL_TT * KSTH further): the three products
// of the split operands in six independent mma chains.
__device__ __forceinline__ void fh_score_steps(float (&slh)[2][4], float (&shl)[2][4],
                                               float (&shh)[2][4], const unsigned short *qa,
                                               const unsigned short *kb, int k0, int k1,
                                               int QSTH, int KSTH) {
#pragma unroll 2
    for (int ks = k0; ks < k1; ++ks) {
        const int k = ks * 16;
        unsigned ah[4], al[4], bh[4], bl[4];
        fh_ldsm4(ah, qa + k);
        fh_ldsm4(al, qa + FL_HB * QSTH + k);
        fh_ldsm4(bh, kb + k);
        fh_ldsm4(bl, kb + FL_TT * KSTH + k);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            fh_mma(slh[nt], al, bh[2 * nt], bh[2 * nt + 1]);
            fh_mma(shl[nt], ah, bl[2 * nt], bl[2 * nt + 1]);
            fh_mma(shh[nt], ah, bh[2 * nt], bh[2 * nt + 1]);
        }
    }
}

template <int NTC, int C>
__device__ __forceinline__ void
fh_body(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
        const unsigned short *__restrict__ qs, const KvDesc *__restrict__ kv,
        float *__restrict__ cl, const int *__restrict__ qe, int S, int H, int K, int R,
        float scale, int nsplit, int QSTH, int KSTH) {
    extern __shared__ float4 smem4[];
    unsigned short *Qh = reinterpret_cast<unsigned short *>(smem4);
    unsigned short *Kh = Qh + 2 * FL_HB * QSTH;
    float *Ss = reinterpret_cast<float *>(Kh + 2 * FL_TT * KSTH);
    int *QE = reinterpret_cast<int *>(Ss + 2 * FL_HB * FL_TT);
    int *TE = QE + 2 * FL_HB;
    const int z = blockIdx.x, s = blockIdx.y, hb = blockIdx.z * FL_HB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, t4 = lane & 3, mi = lane >> 3;
    const int hg = warp & 3, half = warp >> 2;
    const FlSlice sl = fl_slice(kv[s], z, nsplit);
    const float *__restrict__ lat = sl.lat;
    const float *__restrict__ rop = sl.rop;
    const int tb = sl.tb, te = sl.te;
    const int KP = (K + 15) & ~15, KRP = KP + ((R + 15) & ~15), W = KSTH - 8;

    // The block's q rows, split by mla_qsplit, in flight with the first tile (heads past H:
    // zeros, exponent 0); waited for before the first scores.
    {
        const int nc = KRP / 8;  // 16-byte chunks of a plane's row
        const unsigned short *q0 = qs + ((size_t)s * H + hb) * 2 * KRP;
        for (int i = threadIdx.x; i < 2 * FL_HB * nc; i += FL_WARPS * 32) {
            const int r = i / (2 * nc), pn = (i / nc) & 1, c = (i % nc) * 8;
            const int n = r < H - hb ? 16 : 0;
            const unsigned short *src = n ? q0 + ((size_t)r * 2 + pn) * KRP + c : q0;
            fl_cp16(reinterpret_cast<float *>(Qh + (pn * FL_HB + r) * QSTH + c),
                    reinterpret_cast<const float *>(src), n);
        }
        if (threadIdx.x < 2 * FL_HB) {  // each row's two exponents
            const int h = hb + (threadIdx.x >> 1), n = h < H ? 4 : 0;
            const int *src = qe + 2 * ((size_t)s * H + (n ? h : 0)) + (threadIdx.x & 1);
            fl_cp4(reinterpret_cast<float *>(QE + threadIdx.x),
                   reinterpret_cast<const float *>(src), n);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    float fq[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // [segment: latent, rope][head gid, gid + 8]

    float acc[NTC][4];
#pragma unroll
    for (int j = 0; j < NTC; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m[2] = {-COLI_INF, -COLI_INF}, l[2] = {0.f, 0.f};
    int c = 0;  // acc is the context times 2^c (below)
    const int nks = KRP / 16, ks0 = half ? nks / 2 : 0, ks1 = half ? nks : nks / 2;
    // ldmatrix row addresses: q (A: blocks rows 0-7 / 8-15 x k 0-7 / 8-15), the tile for the
    // scores (B: rows n 0-7 x k 0-7, 8-15; n 8-15 x ..) and for the context (B transposed:
    // rows k 0-7 / 8-15 of columns 8j.., then of 8(j + 1)..).
    const unsigned short *qa = Qh + (hg * 16 + (lane & 15)) * QSTH + 8 * (lane >> 4);
    const unsigned short *kb = Kh + ((lane & 7) + 8 * (mi >> 1)) * KSTH + 8 * (mi & 1);
    const unsigned short *vb = Kh + ((lane & 7) + 8 * (mi & 1)) * KSTH + half * 8 * NTC +
                               8 * (mi >> 1);
    const bool vec = ((K | R) & 3) == 0;

    for (int t0 = tb; t0 < te; t0 += FL_TT) {
        __syncthreads();  // every warp is done with the previous tile (and Ss, TE)
        {  // this warp's FL_TT / FL_WARPS rows of the tile, split once
            constexpr int NR = FL_TT / FL_WARPS;
            unsigned *kh = reinterpret_cast<unsigned *>(Kh), *kl = kh + FL_TT * KSTH / 2;
            unsigned *h2[NR], *l2[NR];
            const float *a2[NR], *b2[NR];
            int na[NR], nb[NR], e[NR][2];
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const int r = warp * NR + i, in = t0 + r < te;
                h2[i] = kh + r * KSTH / 2;
                l2[i] = kl + r * KSTH / 2;
                a2[i] = lat + (size_t)(t0 + r) * K;
                b2[i] = rop + (size_t)(t0 + r) * R;
                na[i] = in * K;
                nb[i] = in * R;
            }
            if (vec) fh_rows<true, NR>(h2, l2, a2, na, b2, nb, W, KP, lane, e);
            else fh_rows<false, NR>(h2, l2, a2, na, b2, nb, W, KP, lane, e);
            if (lane == 0) {
#pragma unroll
                for (int i = 0; i < NR; ++i) {
                    TE[2 * (warp * NR + i)] = e[i][0];
                    TE[2 * (warp * NR + i) + 1] = e[i][1];
                }
            }
        }
        if (t0 == tb) {  // the q rows are in
            asm volatile("cp.async.wait_all;" ::: "memory");
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                fq[0][i] = fh_pow2(-QE[2 * (hg * 16 + gid + 8 * i)]);
                fq[1][i] = fh_pow2(-QE[2 * (hg * 16 + gid + 8 * i) + 1]);
            }
        } else {
            __syncthreads();
        }
        fl_prefetch(lat, rop, t0, te, K, R);  // the next tile into L2 meanwhile

        // This lane's rows 2t4, 2t4 + 1, 2t4 + 8, 2t4 + 9: their exponents (latent, rope).
        int er[4], ep[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = (r >> 1) * 8 + 2 * t4 + (r & 1);
            er[r] = TE[2 * row];
            ep[r] = TE[2 * row + 1];
        }

        // Scores of heads hg, rows 0..15, k-steps [ks0, ks1): the latent's steps (below kc),
        // then the rope's, each scaled by its exponents into Ss.
        {
            float shh[2][4] = {}, shl[2][4] = {}, slh[2][4] = {};
            float *o = Ss + (half * FL_HB + hg * 16 + gid) * FL_TT + 2 * t4;
            const int kc = KP / 16;
            float fk[4];
            fh_score_steps(slh, shl, shh, qa, kb, ks0, min(ks1, kc), QSTH, KSTH);
#pragma unroll
            for (int r = 0; r < 4; ++r) fk[r] = fh_pow2(-er[r]);
            fl_scores_out<false>(o, slh, shl, shh, fq[0], fk);
            if (max(ks0, kc) < ks1) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) shh[nt][e] = shl[nt][e] = slh[nt][e] = 0.f;
                fh_score_steps(slh, shl, shh, qa, kb, max(ks0, kc), ks1, QSTH, KSTH);
#pragma unroll
                for (int r = 0; r < 4; ++r) fk[r] = fh_pow2(-ep[r]);
                fl_scores_out<true>(o, slh, shl, shh, fq[1], fk);
            }
        }
        __syncthreads();

        // The tile's smallest latent exponent (its largest row) and P's scale per row.
        int E = 100;
#pragma unroll
        for (int r = 0; r < 4; ++r) E = min(E, er[r]);
        E = min(E, __shfl_xor_sync(0xffffffffu, E, 1));
        E = min(E, __shfl_xor_sync(0xffffffffu, E, 2));
        // acc holds the context times 2^c: c = 14 + E at the first tile, then the least such
        // (the largest rows so far set the scale; a later tile's P is scaled to it).
        const int cn = t0 == tb ? 14 + E : min(c, 14 + E);
        const float sh = t0 == tb ? 1.f : (cn - c >= -126 ? fh_pow2(cn - c) : 0.f);
        c = cn;
        float pf[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) pf[r] = c - er[r] >= -126 ? fh_pow2(c - er[r]) : 0.f;

        // Online softmax of heads gid, gid + 8 over this lane's rows.
        float p[2][4];
        {
            const int rows[4] = {2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9};
            float alpha[2];
            fl_softmax(p, m, l, alpha, Ss + (hg * 16 + gid) * FL_TT, rows, scale, te - t0);
            alpha[0] *= sh;
            alpha[1] *= sh;
            fl_rescale(acc, alpha);
        }
        // Context: acc[heads, cols] += P[heads, rows] @ latent[rows, cols], one k16 step.
        unsigned ah[4], al[4];
        fh_split2(p[0][0] * pf[0], p[0][1] * pf[1], ah[0], al[0]);
        fh_split2(p[1][0] * pf[0], p[1][1] * pf[1], ah[1], al[1]);
        fh_split2(p[0][2] * pf[2], p[0][3] * pf[3], ah[2], al[2]);
        fh_split2(p[1][2] * pf[2], p[1][3] * pf[3], ah[3], al[3]);
#pragma unroll
        for (int j = 0; j < NTC; j += 2) {
            unsigned bh[4], bl[4];
            if (NTC == 1) {
                fh_ldsm2t(bh, vb);
                fh_ldsm2t(bl, vb + FL_TT * KSTH);
            } else {
                fh_ldsm4t(bh, vb + 8 * j);
                fh_ldsm4t(bl, vb + FL_TT * KSTH + 8 * j);
            }
#pragma unroll
            for (int jj = 0; jj < 2 && j + jj < NTC; ++jj) {
                fh_mma(acc[j + jj], al, bh[2 * jj], bh[2 * jj + 1]);
                fh_mma(acc[j + jj], ah, bl[2 * jj], bl[2 * jj + 1]);
                fh_mma(acc[j + jj], ah, bh[2 * jj], bh[2 * jj + 1]);
            }
        }
    }
    {  // the context in its own units: times 2^-c
        const float f = fh_pow2(-c);
#pragma unroll
        for (int j = 0; j < NTC; ++j)
            acc[j][0] *= f, acc[j][1] *= f, acc[j][2] *= f, acc[j][3] *= f;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // a slice without rows still staged q
    __syncthreads();  // the tail's clusters reuse Qh and Ss
    fl_tail<NTC, C>(acc, m, l, reinterpret_cast<float *>(smem4), Ss, pm, pl, pacc, cl, S, H, K,
                    nsplit);
}

// Row r of qfull [rows][K + R] split for mla_flash_h by one warp (lane ``lane``): its hi plane
// [KRP] then its lo plane [KRP] (fp16, laid out as a staged row) at qs + 2 r KRP, and its
// exponents qe[2r] (latent), qe[2r + 1] (rope) (fh_rows: KRP <= 128 FH_MQ). NC as fh_rows'.
// mla_qsplit and mla_absorb_w's fused split (attention.cu declares it) both make q rows so.
template <bool NC>
__device__ __forceinline__ void fh_qrow(unsigned short *__restrict__ qs, int *__restrict__ qe,
                                        const float *__restrict__ qfull, int r, int K, int R,
                                        int KRP, int lane) {
    const float *const a[1] = {qfull + (size_t)r * (K + R)}, *const b[1] = {a[0] + K};
    unsigned *const hi[1] = {reinterpret_cast<unsigned *>(qs + (size_t)r * 2 * KRP)};
    unsigned *const lo[1] = {hi[0] + KRP / 2};
    const int na[1] = {K}, nb[1] = {R};
    int e[1][2];
    const int KP = (K + 15) & ~15;
    if (((K | R) & 3) == 0) fh_rows<true, 1, NC>(hi, lo, a, na, b, nb, KRP, KP, lane, e);
    else fh_rows<false, 1, NC>(hi, lo, a, na, b, nb, KRP, KP, lane, e);
    if (lane == 0) qe[2 * r] = e[0][0], qe[2 * r + 1] = e[0][1];
}

// The q rows split once per call for mla_flash_h (``fh_qrow``): qfull [rows][K + R] (rows =
// S * H) -> qs, qe. One warp a row; grid ceil(rows / 8), block 256.
__global__ void __launch_bounds__(FL_WARPS * 32)
mla_qsplit(unsigned short *__restrict__ qs, int *__restrict__ qe,
           const float *__restrict__ qfull, int rows, int K, int R, int KRP) {
    const int r = blockIdx.x * FL_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    fh_qrow<true>(qs, qe, qfull, r, K, R, KRP, lane);
}

// mla_flash's launch and outputs, its q rows from mla_qsplit (qs, qe); QSTH, KSTH in fp16
// values.
template <int NTC>
__global__ void __launch_bounds__(FL_WARPS * 32, 1)
mla_flash_h(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
            const unsigned short *__restrict__ qs, const KvDesc *__restrict__ kv,
            float *__restrict__ cl, const int *__restrict__ qe, int S, int H, int K, int R,
            float scale, int nsplit, int QSTH, int KSTH) {
    fh_body<NTC, 1>(pm, pl, pacc, qs, kv, cl, qe, S, H, K, R, scale, nsplit, QSTH, KSTH);
}

// mla_flash_c's clusters on mla_flash_h's tiles.
template <int NTC, int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(FL_WARPS * 32, 1)
mla_flash_hc(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
             const unsigned short *__restrict__ qs, const KvDesc *__restrict__ kv,
             float *__restrict__ cl, const int *__restrict__ qe, int S, int H, int K, int R,
             float scale, int nsplit, int QSTH, int KSTH) {
    fh_body<NTC, C>(pm, pl, pacc, qs, kv, cl, qe, S, H, K, R, scale, nsplit, QSTH, KSTH);
}
