// MLA absorbed attention (DeepSeek/GLM "kv_b absorption"): the cache keeps the compressed
// latent [T, K] and rope [T, R] rows; per (token s, head h)
//   qfull[s, h] = [ q_nope[s, h] @ W_k(h)  (K values) | q_rope[s, h] (R values) ]   mla_absorb
//   score[t]    = qfull[s, h] . [latent[t] | rope[t]] * scale, softmax over t           mla_attend
//   cl[h, s]    = sum_t p[t] * latent[t]                                        mla_attend/merge
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
    int pad;
};

// grid (H, ceil(K / 128), ceil(S / 8)), block 128; dynamic shared 8 * Q floats.
// q float32 [S, H, Q + R]; qfull float32 [S, H, K + R]; w = kv_b [H * (Q + V), K] resident.
// Each thread walks one column k down the Q rows of head h; the rows come in batches of
// ABS_U independent element loads so a thread has that many in flight (the loop is latency
// bound otherwise: 6 MB of kv_b at GLM-5.2 shapes, spread over only H * K threads).
#define ABS_U 8
template <int FMT>
__global__ void __launch_bounds__(128)
mla_absorb(float *__restrict__ qfull, const float *__restrict__ q,
           const unsigned char *__restrict__ w, const float *__restrict__ sc, int S, int H, int Q,
           int R, int V, int K, int ld, int ngp, int gs, int gs_shift) {
    extern __shared__ float qs[];  // [8][Q]: q_nope of 8 tokens of this head
    const int h = blockIdx.x, k = blockIdx.y * 128 + threadIdx.x, s0 = blockIdx.z * 8;
    for (int i = threadIdx.x; i < 8 * Q; i += blockDim.x) {
        const int s = i / Q, d = i - s * Q;
        qs[i] = s0 + s < S ? q[((size_t)(s0 + s) * H + h) * (Q + R) + d] : 0.f;
    }
    __syncthreads();
    if (k < K) {
        float acc[8];
#pragma unroll
        for (int s = 0; s < 8; ++s) acc[s] = 0.f;
        for (int d0 = 0; d0 < Q; d0 += ABS_U) {
            float wv[ABS_U];
#pragma unroll
            for (int u = 0; u < ABS_U; ++u) {
                const int o = h * (Q + V) + min(d0 + u, Q - 1);
                wv[u] = load_elem<FMT>(w + (size_t)o * ld, sc, o, k, ngp, gs, gs_shift);
            }
#pragma unroll
            for (int u = 0; u < ABS_U; ++u) {
                if (d0 + u < Q) {
#pragma unroll
                    for (int s = 0; s < 8; ++s)
                        acc[s] = fmaf(qs[s * Q + d0 + u], wv[u], acc[s]);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < 8; ++s)
            if (s0 + s < S) qfull[((size_t)(s0 + s) * H + h) * (K + R) + k] = acc[s];
    }
    if (blockIdx.y == 0) {
        for (int i = threadIdx.x; i < 8 * R; i += blockDim.x) {
            const int s = i / R, d = i - s * R;
            if (s0 + s < S)
                qfull[((size_t)(s0 + s) * H + h) * (K + R) + K + d] =
                    q[((size_t)(s0 + s) * H + h) * (Q + R) + Q + d];
        }
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

// grid (H, S), block 128, dynamic shared nsplit floats.
// cl float32 [H, S, K] (head-major: each head's rows are one gemv job's x).
__global__ void __launch_bounds__(128)
mla_merge(float *__restrict__ cl, const float *__restrict__ pm, const float *__restrict__ pl,
          const float *__restrict__ pacc, int S, int H, int K, int nsplit) {
    extern __shared__ float wz[];  // [nsplit] weights e^(m_z - M) / L
    const int h = blockIdx.x, s = blockIdx.y;
    const size_t base = ((size_t)s * H + h) * nsplit;
    // Every thread computes M and L itself (nsplit is small): no shared reduction to race on.
    float M = -COLI_INF;
    for (int z = 0; z < nsplit; ++z) M = fmaxf(M, pm[base + z]);
    float L = 0.f;
    if (M != -COLI_INF)
        for (int z = 0; z < nsplit; ++z) L += pl[base + z] * expf(pm[base + z] - M);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int z = threadIdx.x; z < nsplit; z += blockDim.x)
        wz[z] = M != -COLI_INF ? expf(pm[base + z] - M) * inv : 0.f;
    __syncthreads();
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        float v = 0.f;
        for (int z = 0; z < nsplit; ++z) v = fmaf(pacc[(base + z) * K + k], wz[z], v);
        cl[((size_t)h * S + s) * K + k] = v;
    }
}
