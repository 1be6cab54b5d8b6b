/* The compute entry points: each checks its arguments as the seed does (a refusal sends
 * nothing), then runs one exchange: the request message, the activations as frame data
 * straight from the caller's buffers, the result read straight into the caller's output.
 *
 * expert_group_issue sends an ExpertGroup call on a connection of its own and returns;
 * expert_group_take reads that call's reply. Several issues may be outstanding per device
 * (taken oldest first); the pointer take returns stays valid until the next issue on that
 * device. Issue and take compute exactly what expert_group computes: the same call.
 */
#include <stdlib.h>
#include <string.h>

#include "cw.h"

#define MAX_PENDING 16

static long g_gpu_calls;

/* The seed's test hook: COLI_GPU_FAIL_AFTER=N makes the compute entry points fail after N
 * successful calls (N=0: all of them); read at each call, as the seed does. */
int cw_fault_injected(void) {
    const char *fa = getenv("COLI_GPU_FAIL_AFTER");
    return fa && __atomic_fetch_add(&g_gpu_calls, 1, __ATOMIC_SEQ_CST) >= atol(fa);
}

static void array(cw_conn *c, int field, const void *p, int64_t d0, int64_t d1, int64_t d2,
                  int nd) {
    int64_t shape[3] = {d0, d1, d2};
    size_t n = 4;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    pb_array(&c->req, field, shape, nd, cw_place(c, p, n), n);
}

int coli_cuda_matmul(ColiCudaTensor **tensor, float *y, const float *x, const void *weights,
                     const float *scales, int fmt, int S, int I, int O, int device) {
    if (cw_fault_injected()) return 0;
    if (S < 1 || !y || !x || !coli_cuda_tensor_upload(tensor, weights, scales, fmt, I, O, device))
        return 0;
    ColiCudaTensor *t = *tensor;
    uint64_t h = cw_handle(t);
    cw_conn *c = h ? cw_acquire(t->w) : NULL;
    if (!c) return 0;
    cw_begin(c);
    pb_uint(&c->req, 1, h);
    array(c, 2, x, S, t->I, 0, 2);
    return cw_release(c, cw_exchange(c, M_MATMUL, y, (size_t)S * (size_t)t->O * 4));
}

static int mlp_args(ColiCudaTensor *g, ColiCudaTensor *u, ColiCudaTensor *d) {
    return g && u && d && g->w == u->w && g->w == d->w && g->device == u->device &&
           g->device == d->device && g->I == u->I && g->O == u->O && d->I == g->O &&
           d->O == g->I;
}

static int mlp(ColiCudaTensor *g, ColiCudaTensor *u, ColiCudaTensor *d, float *y,
               const float *x, int S) {
    uint64_t hg = cw_handle(g), hu = cw_handle(u), hd = cw_handle(d);
    cw_conn *c = hg && hu && hd ? cw_acquire(g->w) : NULL;
    if (!c) return 0;
    cw_begin(c);
    pb_uint(&c->req, 1, hg);
    pb_uint(&c->req, 2, hu);
    pb_uint(&c->req, 3, hd);
    array(c, 4, x, S, g->I, 0, 2);
    return cw_release(c, cw_exchange(c, M_EXPERT_MLP, y, (size_t)S * (size_t)g->I * 4));
}

int coli_cuda_expert_mlp(ColiCudaTensor *gate, ColiCudaTensor *up, ColiCudaTensor *down,
                         float *y, const float *x, int S) {
    if (cw_fault_injected()) return 0;
    if (!x || !y || S < 1 || !mlp_args(gate, up, down)) return 0;
    return mlp(gate, up, down, y, x, S);
}

/* The shared expert: int4 per-row tensors only, as the seed; the worker computes it with
 * float32 activations (the seed rounds them to float16 for its tensor cores). */
int coli_cuda_shared_mlp_w4a16(ColiCudaTensor *gate, ColiCudaTensor *up, ColiCudaTensor *down,
                               float *y, const float *x, int S) {
    if (cw_fault_injected()) return 0;
    if (!x || !y || S < 1 || !mlp_args(gate, up, down) || gate->fmt != 2 || up->fmt != 2 ||
        down->fmt != 2)
        return 0;
    return mlp(gate, up, down, y, x, S);
}

/* -- expert groups -------------------------------------------------------------------- */

typedef struct {
    uint64_t h[64][3];
    int total, D;
    cw_dev *dev;
} group_args;

static int group_check(ColiCudaTensor *const *gates, ColiCudaTensor *const *ups,
                       ColiCudaTensor *const *downs, const int *rows, int count,
                       const float *x, group_args *a) {
    if (!gates || !ups || !downs || !rows || !x || count < 1 || count > 64 || !gates[0])
        return 0;
    ColiCudaTensor *first = gates[0];
    a->D = first->I;
    a->total = 0;
    for (int c = 0; c < count; c++) {
        ColiCudaTensor *g = gates[c], *u = ups[c], *d = downs[c];
        if (!g || !mlp_args(g, u, d) || rows[c] < 1 || g->device != first->device ||
            g->I != first->I || g->O != first->O)
            return 0;
        a->h[c][0] = cw_handle(g);
        a->h[c][1] = cw_handle(u);
        a->h[c][2] = cw_handle(d);
        if (!a->h[c][0] || !a->h[c][1] || !a->h[c][2]) return 0;
        if (a->total > (1 << 30) - rows[c]) return 0;
        a->total += rows[c];
    }
    a->dev = cw_find_dev(first->device);
    return a->dev != NULL;
}

static void group_request(cw_conn *c, const group_args *a, const int *rows, int first,
                          int count, const float *x, int total) {
    cw_begin(c);
    for (int e = first; e < first + count; e++) {
        size_t m = pb_open(&c->req, 1);
        pb_uint(&c->req, 1, a->h[e][0]);
        pb_uint(&c->req, 2, a->h[e][1]);
        pb_uint(&c->req, 3, a->h[e][2]);
        pb_close(&c->req, m);
    }
    size_t r = pb_open(&c->req, 2);
    for (int e = first; e < first + count; e++) pb_varint(&c->req, (uint64_t)rows[e]);
    pb_close(&c->req, r);
    array(c, 3, x, total, a->D, 0, 2);
}

int coli_cuda_expert_group(ColiCudaTensor *const *gates, ColiCudaTensor *const *ups,
                           ColiCudaTensor *const *downs, const int *rows, int count, float *y,
                           const float *x) {
    if (cw_fault_injected()) return 0;
    group_args a;
    if (!y || !group_check(gates, ups, downs, rows, count, x, &a)) return 0;
    cw_worker *w = a.dev->w;
    int step = w->max_experts >= 1 && (int)w->max_experts < count ? (int)w->max_experts : count;
    cw_conn *c = cw_acquire(w);
    if (!c) return 0;
    for (int first = 0; first < count; first += step) { /* a worker with a lower limit */
        int n = count - first < step ? count - first : step, total = 0;
        for (int e = first; e < first + n; e++) total += rows[e];
        group_request(c, &a, rows, first, n, x, total);
        int rc = cw_exchange(c, M_EXPERT_GROUP, y, (size_t)total * (size_t)a.D * 4);
        if (rc) return cw_release(c, rc);
        x += (size_t)total * (size_t)a.D;
        y += (size_t)total * (size_t)a.D;
    }
    return cw_release(c, 0);
}

static void free_taken(cw_dev *d) {
    for (int i = 0; i < d->ntaken; i++) free(d->taken[i]);
    d->ntaken = 0;
}

int coli_cuda_expert_group_issue(ColiCudaTensor *const *gates, ColiCudaTensor *const *ups,
                                 ColiCudaTensor *const *downs, const int *rows, int count,
                                 const float *x) {
    group_args a;
    if (!group_check(gates, ups, downs, rows, count, x, &a)) return 0;
    cw_dev *d = a.dev;
    if (d->w->max_experts >= 1 && (int)d->w->max_experts < count) return 0;
    pthread_mutex_lock(&d->mu);
    free_taken(d); /* results taken before this issue expire now */
    int full = d->npend >= MAX_PENDING;
    pthread_mutex_unlock(&d->mu);
    if (full) return 0;
    size_t bytes = (size_t)a.total * (size_t)a.D * 4;
    cw_pend *p = calloc(1, sizeof *p);
    float *buf = malloc(bytes);
    cw_conn *c = p && buf ? cw_acquire(d->w) : NULL;
    if (!c) {
        free(p);
        free(buf);
        return 0;
    }
    group_request(c, &a, rows, 0, count, x, a.total);
    uint64_t rid = cw_send_call(c, M_EXPERT_GROUP);
    if (!rid) {
        cw_release(c, c->status);
        free(p);
        free(buf);
        return 0;
    }
    p->c = c;
    p->rid = rid;
    p->buf = buf;
    p->bytes = bytes;
    pthread_mutex_lock(&d->mu);
    if (d->tail) d->tail->next = p;
    else d->head = p;
    d->tail = p;
    d->npend++;
    pthread_mutex_unlock(&d->mu);
    return 1;
}

const float *coli_cuda_expert_group_take(int device) {
    cw_dev *d = cw_find_dev(device);
    if (!d) return NULL;
    pthread_mutex_lock(&d->mu);
    cw_pend *p = d->head;
    if (p) {
        d->head = p->next;
        if (!d->head) d->tail = NULL;
        d->npend--;
    }
    pthread_mutex_unlock(&d->mu);
    if (!p) return NULL;
    int rc = cw_recv_reply(p->c, p->rid, M_EXPERT_GROUP, p->buf, p->bytes);
    cw_release(p->c, rc);
    float *buf = p->buf;
    free(p);
    if (rc) {
        free(buf);
        return NULL;
    }
    pthread_mutex_lock(&d->mu);
    if (d->ntaken == d->captaken) {
        int cap = d->captaken ? 2 * d->captaken : 8;
        float **t = realloc(d->taken, (size_t)cap * sizeof *t);
        if (t) { d->taken = t; d->captaken = cap; }
    }
    if (d->ntaken < d->captaken) d->taken[d->ntaken++] = buf;
    else { free(buf); buf = NULL; }
    pthread_mutex_unlock(&d->mu);
    return buf;
}

void cw_devq_drain(cw_dev *d) {
    pthread_mutex_lock(&d->mu);
    cw_pend *p = d->head;
    d->head = d->tail = NULL;
    d->npend = 0;
    free_taken(d);
    pthread_mutex_unlock(&d->mu);
    while (p) {
        cw_pend *n = p->next;
        cw_close(p->c); /* its reply is still coming: the connection is out of step */
        free(p->buf);
        free(p);
        p = n;
    }
}

/* -- attention ------------------------------------------------------------------------ */

static int attention(ColiCudaTensor *w, ColiCudaTensor *proj, float *out, const float *q,
                     const float *latent, const float *rope, int S, int H, int Q, int R, int V,
                     int K, int T, float scale) {
    if (!w || !out || !q || !latent || !rope || S < 1 || H < 1 || Q < 1 || R < 1 || V < 1 ||
        K < 1 || T < S || w->I != K || (int64_t)w->O != (int64_t)H * (Q + V))
        return 0;
    if (proj && (proj->w != w->w || proj->device != w->device ||
                 (int64_t)proj->I != (int64_t)H * V))
        return 0;
    uint64_t hw = cw_handle(w), hp = proj ? cw_handle(proj) : 0;
    cw_conn *c = hw && (!proj || hp) ? cw_acquire(w->w) : NULL;
    if (!c) return 0;
    cw_begin(c);
    pb_uint(&c->req, 1, hw);
    if (hp) pb_uint(&c->req, 2, hp);
    array(c, 3, q, S, H, Q + R, 3);
    array(c, 4, latent, T, K, 0, 2);
    array(c, 5, rope, T, R, 0, 2);
    pb_int(&c->req, 6, Q);
    pb_int(&c->req, 7, R);
    pb_int(&c->req, 8, V);
    pb_float(&c->req, 9, scale);
    size_t out_bytes = (size_t)S * (proj ? (size_t)proj->O : (size_t)H * (size_t)V) * 4;
    return cw_release(c, cw_exchange(c, M_ATTENTION, out, out_bytes));
}

int coli_cuda_attention_absorb(ColiCudaTensor *w, float *ctx, const float *q,
                               const float *latent, const float *rope, int H, int Q, int R,
                               int V, int K, int T, float scale) {
    if (cw_fault_injected()) return 0;
    return attention(w, NULL, ctx, q, latent, rope, 1, H, Q, R, V, K, T, scale);
}

int coli_cuda_attention_absorb_batch(ColiCudaTensor *w, float *ctx, const float *q,
                                     const float *latent, const float *rope, int S, int H,
                                     int Q, int R, int V, int K, int T, float scale) {
    if (cw_fault_injected()) return 0;
    return attention(w, NULL, ctx, q, latent, rope, S, H, Q, R, V, K, T, scale);
}

int coli_cuda_attention_project_batch(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                      const float *q, const float *latent, const float *rope,
                                      int S, int H, int Q, int R, int V, int K, int T,
                                      float scale) {
    if (cw_fault_injected()) return 0; /* proj NULL: the context, as the seed */
    return attention(w, proj, out, q, latent, rope, S, H, Q, R, V, K, T, scale);
}
