// MLA absorbed attention (DeepSeek/GLM "kv_b absorption"): the cache keeps the compressed
// latent [T, K] and rope [T, R] rows; per (token s, head h)
//   qfull[s, h] = [ q_nope[s, h] @ W_k(h)  (K values) | q_rope[s, h] (R values) ]   mla_absorb
//   score[t]    = qfull[s, h] . [latent[t] | rope[t]] * scale, softmax over t      mla_attend/flash
//   cl[h, s]    = sum_t p[t] * latent[t]                                  mla_attend/flash + merge
// and the value projection ctx = cl @ W_v(h)^T runs as gemv jobs (gemv.cu), one per head.
//
// mla_attend splits T over blocks (flash-decoding): each block keeps a running max / sum /
// weighted latent (online softmax) for its slice and HEADS heads, so one KV tile staged in shared
// memory serves HEADS heads; mla_merge combines the slices with their log-sum-exp weights.
// Every reduction is a warp shuffle or follows a __syncthreads: no shared slot is read while
// another thread may still write it.
#include "common.cuh"

struct KvDesc {
    unsigned long long latent, rope;  // float32 [len, K] and [len, R], row-major
    int len;                          // rows this query row sees
    // First of this sequence's new rows in the call's upload (ragged calls): rows src .. the
    // next descriptor's src (the upload's end for the last) land at the cache's rows ending at
    // len. Nondecreasing over the descriptors.
    int src;
};

// The call's new cache rows into their caches: rows b, b + nb, ... of the upload (latent
// float32 [n_new, K], rope float32 [n_new, R]) by this block's threads.
__device__ __forceinline__ void kv_scatter(const KvDesc *__restrict__ kv,
                                           const float *__restrict__ nlat,
                                           const float *__restrict__ nrope, int n_new, int S,
                                           int K, int R, int b, int nb) {
    for (int r = b; r < n_new; r += nb) {
        int lo = 0, hi = S - 1;  // the last descriptor with src <= r owns row r
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (kv[mid].src <= r) lo = mid;
            else hi = mid - 1;
        }
        const KvDesc d = kv[lo];
        const int end = lo + 1 < S ? kv[lo + 1].src : n_new;
        const size_t row = (size_t)(d.len - end + r);
        float *lat = reinterpret_cast<float *>(d.latent) + row * K;
        float *rop = reinterpret_cast<float *>(d.rope) + row * R;
        for (int c = threadIdx.x; c < K; c += blockDim.x) lat[c] = nlat[(size_t)r * K + c];
        for (int c = threadIdx.x; c < R; c += blockDim.x) rop[c] = nrope[(size_t)r * R + c];
    }
}

// What both absorb kernels do besides the product: the rope columns of qfull for tokens
// s0 .. s0 + ns - 1 of head h (the blocks of column group 0), and the call's new cache rows
// (``kv_scatter``, spread over every block of the grid).
__device__ __forceinline__ void absorb_tail(float *__restrict__ qfull, const float *__restrict__ q,
                                            const KvDesc *__restrict__ kv,
                                            const float *__restrict__ nlat,
                                            const float *__restrict__ nrope, int n_new, int S,
                                            int H, int Q, int R, int K, int h, int s0, int ns) {
    if (blockIdx.y == 0) {
        for (int i = threadIdx.x; i < ns * R; i += blockDim.x) {
            const int s = i / R, d = i - s * R;
            if (s0 + s < S)
                qfull[((size_t)(s0 + s) * H + h) * (K + R) + K + d] =
                    q[((size_t)(s0 + s) * H + h) * (Q + R) + Q + d];
        }
    }
    if (n_new > 0)
        kv_scatter(kv, nlat, nrope, n_new, S, K, R,
                   blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z),
                   gridDim.x * gridDim.y * gridDim.z);
}

// grid (H, ceil(K / 128), ceil(S / 8)), block 128 * ABS_P; dynamic shared 4 * (8 * Q +
// (ABS_P - 1) * 8 * 128) bytes. q float32 [S, H, Q + R]; qfull float32 [S, H, K + R];
// w = kv_b [H * (Q + V), K] resident. Thread (k, p) walks column k down part p of the Q rows of
// head h, in batches of ABS_U independent element loads (the walk is latency bound: 6 MB of
// kv_b at GLM-5.2 shapes over few threads); the ABS_P parts meet in shared memory. With
// ABS_P = 4 and Q = 192 a thread makes 2 round trips of 24 loads.
//
// The same launch writes the call's new cache rows (``kv_scatter``): the attention kernels
// after it in the stream read them, and no launch of its own is needed. qs, qe: mla_absorb_w's
// (its arguments are this kernel's), unused here.
#define ABS_U 24
#define ABS_P 4
template <int FMT>
__global__ void __launch_bounds__(128 * ABS_P)
mla_absorb(float *__restrict__ qfull, unsigned short *__restrict__, int *__restrict__,
           const float *__restrict__ q, const unsigned char *__restrict__ w,
           const float *__restrict__ sc, const KvDesc *__restrict__ kv,
           const float *__restrict__ nlat, const float *__restrict__ nrope, int n_new, int S,
           int H, int Q, int R, int V, int K, int ld, int ngp, int gs, int gs_shift) {
    extern __shared__ float qs[];  // [8][Q]: q_nope of 8 tokens of this head; then red
    float *red = qs + 8 * Q;       // [ABS_P - 1][8][128] partial sums of parts 1..
    const int h = blockIdx.x, x = threadIdx.x & 127, part = threadIdx.x >> 7;
    const int k = blockIdx.y * 128 + x, s0 = blockIdx.z * 8;
    for (int i = threadIdx.x; i < 8 * Q; i += blockDim.x) {
        const int s = i / Q, d = i - s * Q;
        qs[i] = s0 + s < S ? q[((size_t)(s0 + s) * H + h) * (Q + R) + d] : 0.f;
    }
    __syncthreads();
    const int dq = (Q + ABS_P - 1) / ABS_P, db = part * dq, de = min(Q, db + dq);
    float acc[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) acc[s] = 0.f;
    if (k < K) {
        for (int d0 = db; d0 < de; d0 += ABS_U) {
            float wv[ABS_U];
#pragma unroll
            for (int u = 0; u < ABS_U; ++u) {
                const int o = h * (Q + V) + min(d0 + u, Q - 1);
                wv[u] = load_elem<FMT>(w + (size_t)o * ld, sc, o, k, ngp, gs, gs_shift);
            }
#pragma unroll
            for (int u = 0; u < ABS_U; ++u) {
                if (d0 + u < de) {
#pragma unroll
                    for (int s = 0; s < 8; ++s)
                        acc[s] = fmaf(qs[s * Q + d0 + u], wv[u], acc[s]);
                }
            }
        }
    }
    if (part > 0) {
#pragma unroll
        for (int s = 0; s < 8; ++s) red[((part - 1) * 8 + s) * 128 + x] = acc[s];
    }
    __syncthreads();
    if (part == 0 && k < K) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            float v = acc[s];
#pragma unroll
            for (int p = 1; p < ABS_P; ++p) v += red[((p - 1) * 8 + s) * 128 + x];
            if (s0 + s < S) qfull[((size_t)(s0 + s) * H + h) * (K + R) + k] = v;
        }
    }
    absorb_tail(qfull, q, kv, nlat, nrope, n_new, S, H, Q, R, K, h, s0, 8);
}

// ---- mla_absorb_w: the same qfull, each warp loading whole 512-byte weight rows ----------
//
// grid (H, ceil(K / 512), ceil(S / SB)), block 256 (8 warps), dynamic shared 4 * (ABW_QS(Q, SB)
// + 4 * SB * 512) bytes. FMT 1..4 (fmt 4: gs a multiple of 4, so a quad shares one scale).
// Block (h, g, z) makes columns [512 g, 512 g + 512) of tokens [SB z, SB z + SB) of head h:
// quads q0 .. q0 + 3 of the lanes' 16-byte chunks of 512-byte block b of every row (512 g =
// b * BLK + 128 q0). Warp w walks rows w, w + 8, ... of W_k(h): one coalesced 16-byte load per
// lane and row, the next ABW_U rows' loads in flight while this batch's FMAs run; lane l keeps
// the 16 columns 128 j + 4 l + k (j, k < 4) for SB tokens in registers. The 8 warps' sums meet
// in shared memory in a fixed tree ((w0 + w4) + (w2 + w6)) + ((w1 + w5) + (w3 + w7)).
// Rope columns and the new cache rows as mla_absorb.
//
// QSPLIT (K <= 512: one column group, so a block holds whole rows): the block also splits its
// rows for mla_flash_h as mla_qsplit does (``fh_qrow`` on the qfull it wrote, after a
// __syncthreads: the same bits), into qs and qe; else qs and qe are unused.
#define ABW_WARPS 8
#define ABW_QS(Q, SB) ((((Q) * (SB)) + 3) & ~3)

template <int SB> struct AbwU { static constexpr int value = SB >= 8 ? 4 : (SB >= 4 ? 6 : 12); };

template <int FMT>
__device__ __forceinline__ void abw_load(const unsigned char *__restrict__ w,
                                         const float *__restrict__ sc, int o, int d, int Q,
                                         int ld, int col0, int ngp, int gs, int gs_shift,
                                         uint4 &c, float (&f)[4]) {
    if (d < Q) {
        c = __ldg(reinterpret_cast<const uint4 *>(w + (size_t)d * ld));
        if (FMT == 4) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                f[j] = __ldg(sc + (size_t)(o + d) * ngp + coli_group(col0 + 128 * j, gs, gs_shift));
        } else {
            f[0] = __ldg(sc + o + d);
        }
    } else {
        c = make_uint4(0u, 0u, 0u, 0u);
        f[0] = f[1] = f[2] = f[3] = 0.f;
    }
}

// Quad qq (run time) of a chunk -> 4 floats, offsets removed, unscaled (decode_quad without
// its register array, which a run-time index would put in local memory).
template <int FMT>
__device__ __forceinline__ void abw_decode(const uint4 &c, int qq, float (&v)[4]) {
    constexpr int PER = FMT == 1 ? 1 : (FMT == 3 ? 4 : 2);  // quads per 32-bit word
    const int wi = qq / PER;
    const unsigned x = wi == 0 ? c.x : (wi == 1 ? c.y : (wi == 2 ? c.z : c.w));
    const unsigned b = x >> ((32 / PER) * (qq - wi * PER));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (FMT == 1) v[k] = coli_magic(((b ^ 0x80808080u) >> (8 * k)) & 0xFFu, 8388608.f + 128.f);
        else if (FMT == 3) v[k] = coli_magic((b >> (2 * k)) & 0x3u, 8388608.f + 2.f);
        else v[k] = coli_magic((b >> (4 * k)) & 0xFu, 8388608.f + 8.f);
    }
}

template <bool NC>
__device__ __forceinline__ void fh_qrow(unsigned short *__restrict__ qs, int *__restrict__ qe,
                                        const float *__restrict__ qfull, int r, int K, int R,
                                        int KRP, int lane);  // in attention_flash_h.cuh, below

template <int FMT, int SB, bool QSPLIT>
__global__ void __launch_bounds__(ABW_WARPS * 32)
mla_absorb_w(float *__restrict__ qfull, unsigned short *__restrict__ qs, int *__restrict__ qe,
             const float *__restrict__ q, const unsigned char *__restrict__ w,
             const float *__restrict__ sc, const KvDesc *__restrict__ kv,
             const float *__restrict__ nlat, const float *__restrict__ nrope, int n_new, int S,
             int H, int Q, int R, int V, int K, int ld, int ngp, int gs, int gs_shift) {
    constexpr int QU = Fmt<FMT>::QUADS, BLK = QU * 128, U = AbwU<SB>::value;
    extern __shared__ float4 abw_sm4[];
    float *qn = reinterpret_cast<float *>(abw_sm4);  // [Q][SB] q_nope, token fastest
    float4 *red = abw_sm4 + ABW_QS(Q, SB) / 4;       // [4][SB][4][32] float4 partial sums
    const int h = blockIdx.x, g = blockIdx.y, s0 = blockIdx.z * SB;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = (g * 512) / BLK, q0 = (g * 512 - b * BLK) >> 7;
    const int col0 = b * BLK + q0 * 128 + 4 * lane;  // this lane's first column (quad j: + 128 j)
    for (int i = threadIdx.x; i < Q * SB; i += ABW_WARPS * 32) {
        const int d = i / SB, s = i - d * SB;
        qn[i] = s0 + s < S ? q[((size_t)(s0 + s) * H + h) * (Q + R) + d] : 0.f;
    }
    __syncthreads();
    const int o = h * (Q + V);
    const unsigned char *wl = w + (size_t)o * ld + b * COLI_BLOCK_BYTES + lane * 16;
    float acc[SB][16];
#pragma unroll
    for (int s = 0; s < SB; ++s)
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[s][e] = 0.f;
    uint4 cur[U];
    float fcur[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u)
        abw_load<FMT>(wl, sc, o, warp + ABW_WARPS * u, Q, ld, col0, ngp, gs, gs_shift, cur[u],
                      fcur[u]);
    for (int d0 = warp; d0 < Q; d0 += ABW_WARPS * U) {
        uint4 nxt[U];
        float fnxt[U][4];
#pragma unroll
        for (int u = 0; u < U; ++u)
            abw_load<FMT>(wl, sc, o, d0 + ABW_WARPS * (U + u), Q, ld, col0, ngp, gs, gs_shift,
                          nxt[u], fnxt[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int d = d0 + ABW_WARPS * u;
            if (d < Q) {
                float qd[SB];
#pragma unroll
                for (int s = 0; s < SB; ++s) qd[s] = qn[d * SB + s];
                if (FMT != 4) {
#pragma unroll
                    for (int s = 0; s < SB; ++s) qd[s] *= fcur[u][0];
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float v[4];
                    abw_decode<FMT>(cur[u], q0 + j, v);
                    if (FMT == 4) {
#pragma unroll
                        for (int k = 0; k < 4; ++k) v[k] *= fcur[u][j];
                    }
#pragma unroll
                    for (int s = 0; s < SB; ++s)
#pragma unroll
                        for (int k = 0; k < 4; ++k) acc[s][4 * j + k] = fmaf(qd[s], v[k], acc[s][4 * j + k]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            cur[u] = nxt[u];
#pragma unroll
            for (int j = 0; j < 4; ++j) fcur[u][j] = fnxt[u][j];
        }
    }
#pragma unroll
    for (int half = 4; half >= 1; half >>= 1) {
        if (warp >= half && warp < 2 * half) {
#pragma unroll
            for (int s = 0; s < SB; ++s)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    red[(((warp - half) * SB + s) * 4 + j) * 32 + lane] =
                        make_float4(acc[s][4 * j], acc[s][4 * j + 1], acc[s][4 * j + 2],
                                    acc[s][4 * j + 3]);
        }
        __syncthreads();
        if (warp < half) {
#pragma unroll
            for (int s = 0; s < SB; ++s)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float4 r = red[((warp * SB + s) * 4 + j) * 32 + lane];
                    acc[s][4 * j] += r.x;
                    acc[s][4 * j + 1] += r.y;
                    acc[s][4 * j + 2] += r.z;
                    acc[s][4 * j + 3] += r.w;
                }
        }
        __syncthreads();
    }
    if (warp == 0) {
#pragma unroll
        for (int s = 0; s < SB; ++s) {
            if (s0 + s >= S) continue;
            float *out = qfull + ((size_t)(s0 + s) * H + h) * (K + R);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int c = col0 + 128 * j + k;
                    if (c < K) out[c] = acc[s][4 * j + k];
                }
        }
    }
    absorb_tail(qfull, q, kv, nlat, nrope, n_new, S, H, Q, R, K, h, s0, SB);
    if constexpr (QSPLIT) {  // warp w splits row w of the block's SB (plain loads: written here)
        __syncthreads();
        const int KRP = ((K + 15) & ~15) + ((R + 15) & ~15);
        for (int s = warp; s < SB && s0 + s < S; s += ABW_WARPS)
            fh_qrow<false>(qs, qe, qfull, (s0 + s) * H + h, K, R, KRP, lane);
    }
}

#define ATT_WARPS 8
#define ATT_TT 8

// grid (ceil(H / (ATT_WARPS * HPW)), S, nsplit), block ATT_WARPS * 32;
// dynamic shared ATT_TT * NPL * 32 floats. NPL = lanes' share of K + R (K + R <= 32 * NPL).
// Outputs per (s, h, split): running max pm, sum pl, and unnormalized weighted latent pacc [K].
template <int NPL, int HPW>
__global__ void __launch_bounds__(ATT_WARPS * 32)
mla_attend(float *__restrict__ pm, float *__restrict__ pl, float *__restrict__ pacc,
           const float *__restrict__ qfull, const KvDesc *__restrict__ kv, int S, int H, int K,
           int R, float scale, int nsplit) {
    constexpr int W = NPL * 32;
    extern __shared__ float4 smem4[];
    float *tile = reinterpret_cast<float *>(smem4);  // [ATT_TT][W]
    const int s = blockIdx.y, z = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const KvDesc d = kv[s];
    const float *__restrict__ lat = reinterpret_cast<const float *>(d.latent);
    const float *__restrict__ rop = reinterpret_cast<const float *>(d.rope);
    const int chunk = ((d.len + nsplit - 1) / nsplit + ATT_TT - 1) / ATT_TT * ATT_TT;
    const int tb = z * chunk, te = min(d.len, tb + chunk);
    const int KR = K + R;

    int head[HPW];
    float qr[HPW][NPL], acc[HPW][NPL], m[HPW], l[HPW];
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
        head[j] = (blockIdx.x * ATT_WARPS + warp) * HPW + j;
        const bool ok = head[j] < H;
        m[j] = -COLI_INF;
        l[j] = 0.f;
#pragma unroll
        for (int n = 0; n < NPL; ++n) {
            const int c = lane + 32 * n;
            qr[j][n] = (ok && c < KR) ? qfull[((size_t)s * H + head[j]) * KR + c] : 0.f;
            acc[j][n] = 0.f;
        }
    }

    for (int t0 = tb; t0 < te; t0 += ATT_TT) {
        __syncthreads();  // every warp is done with the previous tile
        // Constant trip count (W, the block size are compile-time): fully unrolled, so every
        // thread's loads of the tile are in flight together.
#pragma unroll
        for (int it = 0; it < (ATT_TT * W + ATT_WARPS * 32 - 1) / (ATT_WARPS * 32); ++it) {
            const int i = threadIdx.x + it * (ATT_WARPS * 32);
            if (i >= ATT_TT * W) break;
            const int t = i / W, c = i - t * W, row = t0 + t;
            float v = 0.f;
            if (row < te) {
                if (c < K) v = lat[(size_t)row * K + c];
                else if (c < KR) v = rop[(size_t)row * R + (c - K)];
            }
            tile[i] = v;
        }
        __syncthreads();
        float sc[HPW][ATT_TT];
#pragma unroll
        for (int t = 0; t < ATT_TT; ++t) {
#pragma unroll
            for (int j = 0; j < HPW; ++j) sc[j][t] = 0.f;
#pragma unroll
            for (int n = 0; n < NPL; ++n) {
                const float v = tile[t * W + lane + 32 * n];
#pragma unroll
                for (int j = 0; j < HPW; ++j) sc[j][t] = fmaf(qr[j][n], v, sc[j][t]);
            }
            // Keep ptxas from hoisting all ATT_TT * NPL tile loads at once (register spills).
            asm volatile("" ::: "memory");
        }
        float (&p)[HPW][ATT_TT] = sc;  // probabilities overwrite the scores
#pragma unroll
        for (int j = 0; j < HPW; ++j) {
            float mt = -COLI_INF;
#pragma unroll
            for (int t = 0; t < ATT_TT; ++t) {
                const float v = warp_sum(sc[j][t]) * scale;
                sc[j][t] = t0 + t < te ? v : -COLI_INF;
                mt = fmaxf(mt, sc[j][t]);
            }
            const float mn = fmaxf(m[j], mt);  // finite: row t0 < te is valid
            const float alpha = expf(m[j] - mn);
            float sum = 0.f;
#pragma unroll
            for (int t = 0; t < ATT_TT; ++t) {
                p[j][t] = expf(p[j][t] - mn);
                sum += p[j][t];
            }
            l[j] = l[j] * alpha + sum;
            m[j] = mn;
#pragma unroll
            for (int n = 0; n < NPL; ++n) acc[j][n] *= alpha;
        }
#pragma unroll
        for (int t = 0; t < ATT_TT; ++t) {
#pragma unroll
            for (int n = 0; n < NPL; ++n) {
                const float v = tile[t * W + lane + 32 * n];
#pragma unroll
                for (int j = 0; j < HPW; ++j) acc[j][n] = fmaf(p[j][t], v, acc[j][n]);
            }
            asm volatile("" ::: "memory");
        }
    }

#pragma unroll
    for (int j = 0; j < HPW; ++j) {
        if (head[j] >= H) continue;
        const size_t slot = ((size_t)s * H + head[j]) * nsplit + z;
        if (lane == 0) {
            pm[slot] = m[j];
            pl[slot] = l[j];
        }
#pragma unroll
        for (int n = 0; n < NPL; ++n) {
            const int c = lane + 32 * n;
            if (c < K) pacc[slot * K + c] = acc[j][n];
        }
    }
}

// grid (H, S, ceil(K / (128 / ZG))), block 128, dynamic shared ``merge_smem`` floats:
// [nsplit] e^(m_z - M) (rounded up to 4), then [ZG - 1][128 / ZG] partial column sums.
// cl float32 [H, S, K] (head-major: each head's rows are one gemv job's x).
// M and L are block reductions (one pm / pl load per thread and split, not a serial walk per
// thread). ZG = 1: each thread walks all splits of one column, 16 pacc loads in flight; ZG = 4
// (many splits): the block's 4 warps take the splits z = w, w + 4, ... of 32 columns each, a
// quarter of the dependent round trips, and meet in shared memory in warp order.
template <int ZG>
__global__ void __launch_bounds__(128)
mla_merge(float *__restrict__ cl, const float *__restrict__ pm, const float *__restrict__ pl,
          const float *__restrict__ pacc, int S, int H, int K, int nsplit) {
    constexpr int NC = 128 / ZG;  // columns per block
    extern __shared__ float wz[];  // [nsplit] e^(m_z - M), then the partial column sums
    __shared__ float red[2][4];    // per-warp max, then per-warp sum
    const int h = blockIdx.x, s = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t base = ((size_t)s * H + h) * nsplit;
    float M = -COLI_INF;
    for (int z = threadIdx.x; z < nsplit; z += 128) M = fmaxf(M, pm[base + z]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (lane == 0) red[0][warp] = M;
    __syncthreads();
    M = fmaxf(fmaxf(red[0][0], red[0][1]), fmaxf(red[0][2], red[0][3]));
    float L = 0.f;
    for (int z = threadIdx.x; z < nsplit; z += 128) {
        const float e = M != -COLI_INF ? expf(pm[base + z] - M) : 0.f;  // empty slices: 0
        wz[z] = e;
        L = fmaf(pl[base + z], e, L);
    }
    L = warp_sum(L);
    if (lane == 0) red[1][warp] = L;
    __syncthreads();  // wz and red[1] are written
    L = (red[1][0] + red[1][1]) + (red[1][2] + red[1][3]);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const int zg = threadIdx.x / NC, c = threadIdx.x - zg * NC, k = blockIdx.z * NC + c;
    float sum = 0.f;
    if (k < K) {
        const float *p = pacc + base * K + k;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        int z = zg;
#pragma unroll 4
        for (; z + 3 * ZG < nsplit; z += 4 * ZG) {
#pragma unroll
            for (int u = 0; u < 4; ++u)
                v[u] = fmaf(p[(size_t)(z + u * ZG) * K], wz[z + u * ZG], v[u]);
        }
        for (; z < nsplit; z += ZG) v[0] = fmaf(p[(size_t)z * K], wz[z], v[0]);
        sum = (v[0] + v[1]) + (v[2] + v[3]);
    }
    if (ZG > 1) {
        float *zr = wz + ((nsplit + 3) & ~3);
        if (zg > 0) zr[(zg - 1) * NC + c] = sum;
        __syncthreads();
        if (zg > 0) return;
#pragma unroll
        for (int j = 1; j < ZG; ++j) sum += zr[(j - 1) * NC + c];
    }
    if (k < K) cl[((size_t)h * S + s) * K + k] = sum * inv;
}

#include "attention_flash.cuh"
#include "attention_flash_h.cuh"
