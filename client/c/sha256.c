/* SHA-256 (FIPS 180-4) for upload content hashes, so the library needs no OpenSSL.
 *
 * content hash = SHA-256(b"coliworker.tensor.v1\0" || fmt, I, O, group_size as int32 LE
 *                        || weight bytes || scale bytes)   (UploadHeader.content_hash)
 */
#include <stdlib.h>
#include <string.h>

#include "cw.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define CW_SHA_NI 1
#endif

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void blocks(uint32_t h[8], const uint8_t *p, size_t nblocks) {
    while (nblocks--) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
                   (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6],
                 k = h[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) +
                          K256[i] + w[i];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            k = g; g = f; f = e; e = d + t1;
            d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d;
        h[4] += e; h[5] += f; h[6] += g; h[7] += k;
        p += 64;
    }
}

#ifdef CW_SHA_NI
/* The x86 SHA extensions: ~6x the portable rounds (a 6.3 MB int4 expert tensor hashes in
 * ~4 ms instead of ~25), chosen at run time. */
__attribute__((target("sha,sse4.1"))) static void blocks_ni(uint32_t h[8], const uint8_t *p,
                                                           size_t nblocks) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1); /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);        /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);             /* CDGH */
    while (nblocks--) {
        __m128i abef = s0, cdgh = s1, w[4];
        for (int i = 0; i < 16; i++) {
            __m128i m;
            if (i < 4) {
                m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), swap);
            } else { /* W[4i..4i+3] from the 16 before them */
                m = _mm_sha256msg1_epu32(w[(i - 4) & 3], w[(i - 3) & 3]);
                m = _mm_add_epi32(m, _mm_alignr_epi8(w[(i - 1) & 3], w[(i - 2) & 3], 4));
                m = _mm_sha256msg2_epu32(m, w[(i - 1) & 3]);
            }
            w[i & 3] = m;
            m = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K256[4 * i]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, m);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(m, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        p += 64;
    }
    t = _mm_shuffle_epi32(s0, 0x1B);               /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);              /* DCHG */
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(t, s1, 0xF0)); /* DCBA */
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(s1, t, 8));    /* HGFE */
}

static int has_sha_ni(void) {
    static int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        int sse41 = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 19)) && (c & (1u << 9));
        int sha = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
        known = sse41 && sha && !getenv("COLIWORKER_NO_SHA_NI");
    }
    return known;
}
#endif

static void run_blocks(uint32_t h[8], const uint8_t *p, size_t nblocks) {
#ifdef CW_SHA_NI
    if (has_sha_ni()) {
        blocks_ni(h, p, nblocks);
        return;
    }
#endif
    blocks(h, p, nblocks);
}

void cw_sha256_init(cw_sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->bytes = 0;
    s->fill = 0;
}

void cw_sha256_update(cw_sha256 *s, const void *data, size_t n) {
    const uint8_t *p = data;
    s->bytes += n;
    if (s->fill) {
        size_t k = 64 - s->fill < n ? 64 - s->fill : n;
        memcpy(s->buf + s->fill, p, k);
        s->fill += k; p += k; n -= k;
        if (s->fill < 64) return;
        run_blocks(s->h, s->buf, 1);
        s->fill = 0;
    }
    if (n >= 64) {
        run_blocks(s->h, p, n / 64);
        p += n & ~(size_t)63;
        n &= 63;
    }
    memcpy(s->buf, p, n);
    s->fill = n;
}

void cw_sha256_final(cw_sha256 *s, uint8_t out[32]) {
    uint64_t bits = s->bytes * 8;
    uint8_t pad[72] = {0x80};
    size_t k = (s->fill < 56 ? 56 : 120) - s->fill;
    for (int i = 0; i < 8; i++) pad[k + i] = (uint8_t)(bits >> (56 - 8 * i));
    cw_sha256_update(s, pad, k + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

void cw_content_hash(int fmt, int I, int O, int gs, const void *w, size_t wbytes,
                     const void *s, size_t sbytes, uint8_t out[32]) {
    static const char prefix[] = "coliworker.tensor.v1"; /* + its NUL: 21 bytes */
    cw_sha256 h;
    uint8_t dims[16];
    int32_t v[4] = {fmt, I, O, gs};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) dims[4 * i + j] = (uint8_t)((uint32_t)v[i] >> (8 * j));
    cw_sha256_init(&h);
    cw_sha256_update(&h, prefix, sizeof prefix);
    cw_sha256_update(&h, dims, sizeof dims);
    if (wbytes) cw_sha256_update(&h, w, wbytes);
    if (sbytes) cw_sha256_update(&h, s, sbytes);
    cw_sha256_final(&h, out);
}
