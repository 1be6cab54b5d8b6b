/* test_ref: the harness and the float64 reference that test_abi.c and test_conn.c share
 * (declared in test_ref.h): the check counters, the xorshift rng that main seeds, the PAUSE
 * handshake, host tensors (random content and its dequantised float64 copy), the reference
 * matmul / SwiGLU MLP / MLA absorbed attention, and the fixtures tests in both files build:
 * experts and expert groups with their reference output, ragged KV sequences and one
 * checked ragged step.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_ref.h"

int failures, checks;
uint64_t rng_state;

static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double unif(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }
float normal(void) {
    double u = unif() + 1e-12, v = unif();
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}
int irange(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); }
float *randn(size_t n) {
    float *a = malloc(n * sizeof *a + 4);
    for (size_t i = 0; i < n; i++) a[i] = normal();
    return a;
}

void pause_for(const char *what) {
    char line[64];
    printf("PAUSE %s\n", what);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) exit(3);
}

/* -- host tensors and the float64 reference ------------------------------------------ */

static size_t row_bytes(int fmt, int I) {
    return fmt == 0 ? 4u * I : fmt == 1 ? (size_t)I : fmt == 3 ? (I + 3u) / 4 : (I + 1u) / 2;
}

static void dequant(Host *h) {
    size_t rb = row_bytes(h->fmt, h->I);
    int ng = h->fmt == 4 ? (h->I + h->gs - 1) / h->gs : 1;
    for (int o = 0; o < h->O; o++)
        for (int i = 0; i < h->I; i++) {
            const uint8_t *q = h->w + (size_t)o * rb;
            double v;
            switch (h->fmt) {
            case 0: { float f; memcpy(&f, q + 4 * i, 4); v = f; break; }
            case 1: v = (int8_t)q[i] * (double)h->s[o]; break;
            case 2: v = ((i & 1 ? q[i / 2] >> 4 : q[i / 2] & 15) - 8) * (double)h->s[o]; break;
            case 3: v = (((q[i / 4] >> (2 * (i % 4))) & 3) - 2) * (double)h->s[o]; break;
            default:
                v = ((i & 1 ? q[i / 2] >> 4 : q[i / 2] & 15) - 8) *
                    (double)h->s[(size_t)o * ng + i / h->gs];
            }
            h->deq[(size_t)o * h->I + i] = v;
        }
}

Host make(int fmt, int I, int O, int gs) {
    Host h = {fmt, I, O, fmt == 4 ? gs : 0, NULL, NULL, 0, 0, NULL, NULL};
    h.wb = row_bytes(fmt, I) * O;
    h.ns = fmt == 0 ? 0 : fmt == 4 ? (size_t)O * ((I + gs - 1) / gs) : (size_t)O;
    h.w = malloc(h.wb + 1);
    h.s = malloc(h.ns * 4 + 4);
    if (fmt == 0) {
        for (size_t i = 0; i < h.wb / 4; i++) ((float *)h.w)[i] = normal() * 0.3f;
    } else {
        for (size_t i = 0; i < h.wb; i++) h.w[i] = (uint8_t)rnd();
    }
    for (size_t i = 0; i < h.ns; i++) h.s[i] = (float)(0.01 + 0.05 * unif());
    h.deq = malloc((size_t)O * I * sizeof(double));
    dequant(&h);
    return h;
}

int upload(Host *h, int device) {
    return h->fmt == 4
               ? coli_cuda_tensor_upload_g(&h->t, h->w, h->s, h->fmt, h->I, h->O, device, h->gs)
               : coli_cuda_tensor_upload(&h->t, h->w, h->s, h->fmt, h->I, h->O, device);
}

void drop(Host *h) {
    coli_cuda_tensor_free(h->t);
    h->t = NULL;
    free(h->w); free(h->s); free(h->deq);
    h->w = NULL; h->s = NULL; h->deq = NULL;
}

/* y[S, O] = x[S, I] W^T */
void ref_matmul(const Host *h, const double *x, double *y, int S) {
    for (int s = 0; s < S; s++)
        for (int o = 0; o < h->O; o++) {
            double a = 0;
            for (int i = 0; i < h->I; i++)
                a += x[(size_t)s * h->I + i] * h->deq[(size_t)o * h->I + i];
            y[(size_t)s * h->O + o] = a;
        }
}

double *to_double(const float *x, size_t n) {
    double *d = malloc(n * sizeof *d + 8);
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

void ref_mlp(const Host *g, const Host *u, const Host *d, const float *x, double *y, int S) {
    int D = g->I, I = g->O;
    double *xd = to_double(x, (size_t)S * D), *a = malloc((size_t)S * I * 8),
           *b = malloc((size_t)S * I * 8);
    ref_matmul(g, xd, a, S);
    ref_matmul(u, xd, b, S);
    for (size_t i = 0; i < (size_t)S * I; i++) a[i] = a[i] / (1 + exp(-a[i])) * b[i];
    ref_matmul(d, a, y, S);
    free(xd); free(a); free(b);
}

int check_matmul(Host *h, const float *x, int S, int dev, const char *what) {
    float *y = malloc((size_t)S * h->O * sizeof *y + 4);
    double *xd = to_double(x, (size_t)S * h->I), *ref = malloc((size_t)S * h->O * 8 + 8);
    ref_matmul(h, xd, ref, S);
    const int f0 = failures;
    CHECK(coli_cuda_matmul(&h->t, y, x, NULL, NULL, h->fmt, S, h->I, h->O, dev), "%s", what);
    CLOSE(what, y, ref, (size_t)S * h->O);
    free(y);
    free(xd);
    free(ref);
    return failures == f0;
}

double rel_err(const float *y, const double *ref, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)y[i] - ref[i]);
        if (!(e <= num)) num = e; /* NaN counts */
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return num / den;
}

/* MLA absorbed attention: query row s of heads [nh, Q+R] sees rows [0, n[s]) of its cache. */
void ref_attention(const Host *kvb, const Host *proj, const float *q, const float *const *lat,
                   const float *const *rope, const int *n, int S, int nh, int Q, int R,
                   int V, int K, float scale, double *out) {
    double *ctx = calloc((size_t)nh * V, sizeof *ctx);
    double *qa = malloc(K * sizeof *qa), *cl = malloc(K * sizeof *cl);
    for (int s = 0; s < S; s++) {
        int T = n[s];
        double *p = malloc(T * sizeof *p);
        for (int h = 0; h < nh; h++) {
            const float *qs = q + ((size_t)s * nh + h) * (Q + R);
            const double *W = kvb->deq + (size_t)h * (Q + V) * K;
            for (int k = 0; k < K; k++) {
                double a = 0;
                for (int d = 0; d < Q; d++) a += qs[d] * W[(size_t)d * K + k];
                qa[k] = a;
            }
            double mx = -1e300, sum = 0;
            for (int t = 0; t < T; t++) {
                double a = 0;
                for (int k = 0; k < K; k++) a += qa[k] * lat[s][(size_t)t * K + k];
                for (int d = 0; d < R; d++) a += qs[Q + d] * rope[s][(size_t)t * R + d];
                p[t] = a * scale;
                if (p[t] > mx) mx = p[t];
            }
            for (int t = 0; t < T; t++) sum += p[t] = exp(p[t] - mx);
            for (int k = 0; k < K; k++) {
                double a = 0;
                for (int t = 0; t < T; t++) a += p[t] / sum * lat[s][(size_t)t * K + k];
                cl[k] = a;
            }
            for (int v = 0; v < V; v++) {
                double a = 0;
                for (int k = 0; k < K; k++) a += cl[k] * W[(size_t)(Q + v) * K + k];
                ctx[(size_t)h * V + v] = a;
            }
        }
        free(p);
        if (proj) {
            for (int o = 0; o < proj->O; o++) {
                double a = 0;
                for (int j = 0; j < nh * V; j++) a += ctx[j] * proj->deq[(size_t)o * nh * V + j];
                out[(size_t)s * proj->O + o] = a;
            }
        } else {
            memcpy(out + (size_t)s * nh * V, ctx, (size_t)nh * V * sizeof *ctx);
        }
    }
    free(ctx); free(qa); free(cl);
}

void stats(int device, size_t *count, size_t *bytes) { coli_cuda_stats(device, count, bytes); }

/* -- experts --------------------------------------------------------------------------- */

Expert expert(int D, int I, int k, int dev) {
    Expert e;
    int f[3] = {(k + 2) % 5, (k + 4) % 5, k % 5}; /* every format in every role */
    e.g = make(f[0], D, I, 5);
    e.u = make(f[1], D, I, 8);
    e.d = make(f[2], I, D, 7);
    CHECK(upload(&e.g, dev) && upload(&e.u, dev) && upload(&e.d, dev), "expert upload");
    return e;
}

void drop_expert(Expert *e) {
    drop(&e->g);
    drop(&e->u);
    drop(&e->d);
}

void group_make(Group *G, int n, int D, int I, int dev, int max_rows) {
    G->n = n; G->D = D; G->I = I; G->total = 0;
    for (int c = 0; c < n; c++) {
        G->e[c] = expert(D, I, c, dev);
        G->gs[c] = G->e[c].g.t; G->us[c] = G->e[c].u.t; G->ds[c] = G->e[c].d.t;
        G->rows[c] = irange(1, max_rows);
        G->total += G->rows[c];
    }
    G->x = randn((size_t)G->total * D);
    G->ref = malloc((size_t)G->total * D * 8);
    for (int c = 0, off = 0; c < n; off += G->rows[c++])
        ref_mlp(&G->e[c].g, &G->e[c].u, &G->e[c].d, G->x + (size_t)off * D,
                G->ref + (size_t)off * D, G->rows[c]);
}

void group_drop(Group *G) {
    for (int c = 0; c < G->n; c++) drop_expert(&G->e[c]);
    free(G->x);
    free(G->ref);
}

/* -- attention ------------------------------------------------------------------------- */

const float SCALE = 0.288675f; /* 1/sqrt(Q+R) */

void seq_init(Seq *s, int cap, int len) {
    s->lat = randn((size_t)cap * Kd);
    s->rope = randn((size_t)cap * Rd);
    s->cap = cap;
    s->len = len;
}

/* one ragged step over seqs[0..S) with keys; checks against the reference */
int ragged_step(Host *kvb, Host *proj, Seq *seqs, const void **keys, int S, int T,
                const char *what) {
    const float *L[16], *Rp[16];
    int n[16];
    for (int s = 0; s < S; s++) { L[s] = seqs[s].lat; Rp[s] = seqs[s].rope; n[s] = seqs[s].len; }
    float *q = randn((size_t)S * H * (Qd + Rd)), *out = malloc((size_t)S * Dout * 4);
    double *ref = malloc((size_t)S * Dout * 8);
    int ok = coli_cuda_attention_project_ragged(kvb->t, proj->t, out, q, keys, L, Rp, n, S, H, Qd,
                                                Rd, Vd, Kd, T, SCALE);
    if (ok) {
        ref_attention(kvb, proj, q, L, Rp, n, S, H, Qd, Rd, Vd, Kd, SCALE, ref);
        CLOSE(what, out, ref, (size_t)S * Dout);
    }
    free(q); free(out); free(ref);
    return ok;
}
