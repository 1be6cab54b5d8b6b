/* Ragged attention with the KV caches resident on the worker.
 *
 * The engine names a sequence by an opaque pointer (keys[s]) and hands its whole host
 * cache each call (latent[s] [lengths[s], K], rope[s] [lengths[s], R]). Per kv_b tensor
 * the library maps each key to a worker sequence id and remembers the rows the worker
 * holds, with a 64-bit fingerprint of each. A call sends only what changed:
 *
 *   start = 1 + the highest row j < min(lengths[s], resident) whose fingerprint still
 *           matches the host row (rows below it are taken as unchanged: a KV cache changes
 *           by truncation and append), so a decode step hashes one row and sends one;
 *   rows start..lengths[s]-1 go with the call; start < resident rolls the worker back.
 *
 * A shrinking length (rollback), rows rewritten in place and a key reused for a new
 * sequence all land on the right start, where the seed's pointer cache went stale.
 *
 * Freeing policy: a sequence not used by the last COLIWORKER_SEQ_IDLE_CALLS (1024) ragged
 * calls on its kv_b is freed on the worker (FreeSequence), and at most COLIWORKER_SEQ_MAX
 * (4096) are kept per kv_b (least recently used go first); a freed one that comes back is
 * sent again from row 0. Freeing the kv_b tensor frees all of its sequences. A sequence
 * the worker evicted under memory pressure (FAILED_PRECONDITION) is sent again from 0.
 */
#include <stdlib.h>
#include <string.h>

#include "cw.h"

typedef struct {
    const void *key;
    uint64_t id, epoch, last;
    int K, R;
    int64_t len;      /* rows the worker holds, as far as this process knows */
    uint64_t *fp;     /* fingerprints of rows [0, len) (and of rows being sent) */
    size_t fp_cap;
} cw_seq;

struct cw_seqtab {
    cw_seq *e;
    size_t n, cap;
    int32_t *slot;    /* open addressing: index into e, -1 empty */
    size_t nslot;
    uint64_t calls;
};

static uint64_t g_seq_ids;

static size_t hash_key(const void *k, size_t mask) {
    uint64_t x = (uint64_t)(uintptr_t)k * 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 17) & mask;
}

static int rebuild(struct cw_seqtab *t, size_t nslot) {
    int32_t *s = malloc(nslot * sizeof *s);
    if (!s) return 0;
    for (size_t i = 0; i < nslot; i++) s[i] = -1;
    for (size_t i = 0; i < t->n; i++) {
        size_t j = hash_key(t->e[i].key, nslot - 1);
        while (s[j] >= 0) j = (j + 1) & (nslot - 1);
        s[j] = (int32_t)i;
    }
    free(t->slot);
    t->slot = s;
    t->nslot = nslot;
    return 1;
}

static cw_seq *find(struct cw_seqtab *t, const void *key) {
    if (!t->nslot) return NULL;
    for (size_t j = hash_key(key, t->nslot - 1);; j = (j + 1) & (t->nslot - 1)) {
        if (t->slot[j] < 0) return NULL;
        if (t->e[t->slot[j]].key == key) return &t->e[t->slot[j]];
    }
}

/* Room for `extra` more sequences, so pointers into t->e stay valid through one call. */
static int reserve(struct cw_seqtab *t, size_t extra) {
    if (t->n + extra > t->cap) {
        size_t cap = t->cap ? t->cap : 16;
        while (cap < t->n + extra) cap *= 2;
        cw_seq *e = realloc(t->e, cap * sizeof *e);
        if (!e) return 0;
        t->e = e;
        t->cap = cap;
    }
    size_t nslot = t->nslot ? t->nslot : 64;
    while (nslot < 2 * (t->n + extra)) nslot *= 2;
    return nslot == t->nslot || rebuild(t, nslot);
}

static cw_seq *insert(struct cw_seqtab *t, const void *key) {
    cw_seq *s = &t->e[t->n];
    memset(s, 0, sizeof *s);
    s->key = key;
    s->id = __atomic_add_fetch(&g_seq_ids, 1, __ATOMIC_RELAXED);
    size_t j = hash_key(key, t->nslot - 1);
    while (t->slot[j] >= 0) j = (j + 1) & (t->nslot - 1);
    t->slot[j] = (int32_t)t->n++;
    return s;
}

void cw_seqtab_free(struct cw_seqtab *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n; i++) free(t->e[i].fp);
    free(t->e);
    free(t->slot);
    free(t);
}

/* FNV-1a over the row's 32-bit words, folded: enough to tell a changed row. */
static uint64_t fingerprint(const float *l, int K, const float *r, int R) {
    uint64_t h = 0xcbf29ce484222325ull;
    const uint32_t *a = (const uint32_t *)l, *b = (const uint32_t *)r;
    for (int i = 0; i < K; i++) h = (h ^ a[i]) * 0x100000001b3ull;
    for (int i = 0; i < R; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static int fp_room(cw_seq *s, size_t n) {
    if (n <= s->fp_cap) return 1;
    size_t cap = s->fp_cap ? s->fp_cap : 64;
    while (cap < n) cap *= 2;
    uint64_t *p = realloc(s->fp, cap * sizeof *p);
    if (!p) return 0;
    s->fp = p;
    s->fp_cap = cap;
    return 1;
}

static void free_sequence(cw_conn *c, uint64_t id, uint64_t kv_b) {
    cw_begin(c);
    pb_uint(&c->req, 1, id);
    pb_uint(&c->req, 2, kv_b);
    cw_exchange(c, M_FREE_SEQUENCE, NULL, 0);
}

/* Drop sequences idle for seq_idle_calls calls, then the least recently used beyond
 * seq_max, freeing them on the worker through c (best effort: a dead one goes anyway). */
static void sweep(struct cw_seqtab *t, cw_conn *c, uint64_t kv_b, uint64_t epoch) {
    size_t keep = 0, n = t->n;
    uint64_t cutoff = t->calls > (uint64_t)cw_cfg.seq_idle_calls
                          ? t->calls - (uint64_t)cw_cfg.seq_idle_calls : 0;
    if (n > (size_t)cw_cfg.seq_max) { /* the (n - max)th oldest use becomes the cutoff */
        uint64_t *lasts = malloc(n * sizeof *lasts);
        if (lasts) {
            for (size_t i = 0; i < n; i++) lasts[i] = t->e[i].last;
            for (size_t i = 0; i + (size_t)cw_cfg.seq_max < n; i++) /* partial selection */
                for (size_t j = i + 1; j < n; j++)
                    if (lasts[j] < lasts[i]) { uint64_t x = lasts[i]; lasts[i] = lasts[j]; lasts[j] = x; }
            uint64_t lru = lasts[n - (size_t)cw_cfg.seq_max - 1] + 1;
            if (lru > cutoff) cutoff = lru < t->calls ? lru : t->calls; /* never this call's */
            free(lasts);
        }
    }
    for (size_t i = 0; i < n; i++) {
        cw_seq *s = &t->e[i];
        if (s->last < cutoff) {
            if (s->len > 0 && s->epoch == epoch && c && c->status >= 0)
                free_sequence(c, s->id, kv_b);
            free(s->fp);
            continue;
        }
        t->e[keep++] = *s;
    }
    if (keep != n) {
        t->n = keep;
        rebuild(t, t->nslot);
    }
}

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (const void *const *)a, y = (uintptr_t) * (const void *const *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    cw_seq *seq;
    int64_t start, len;
} plan_row;

/* One call for sequences [s0, s0 + n) of the plan. */
static int ragged_call(cw_conn *c, uint64_t hw, uint64_t hp, float *out, const float *q,
                       const float *const *latent, const float *const *rope, plan_row *plan,
                       int s0, int n, int H, int Q, int R, int V, int K, float scale,
                       size_t out_row) {
    cw_begin(c);
    pb_uint(&c->req, 1, hw);
    pb_uint(&c->req, 2, hp);
    int64_t qs[3] = {n, H, Q + R};
    size_t qb = (size_t)n * (size_t)H * (size_t)(Q + R) * 4;
    pb_array(&c->req, 3, qs, 3, cw_place(c, q + (size_t)s0 * H * (Q + R), qb), qb);
    for (int i = s0; i < s0 + n; i++) {
        plan_row *p = &plan[i];
        int64_t cnt = p->len - p->start;
        size_t m = pb_open(&c->req, 4);
        pb_uint(&c->req, 1, p->seq->id);
        pb_int(&c->req, 2, p->start);
        if (cnt > 0) {
            int64_t ls[2] = {cnt, K}, rs[2] = {cnt, R};
            size_t lb = (size_t)cnt * (size_t)K * 4, rb = (size_t)cnt * (size_t)R * 4;
            pb_array(&c->req, 3, ls, 2, cw_place(c, latent[i] + (size_t)p->start * K, lb), lb);
            pb_array(&c->req, 4, rs, 2, cw_place(c, rope[i] + (size_t)p->start * R, rb), rb);
        }
        pb_close(&c->req, m);
    }
    pb_int(&c->req, 5, Q);
    pb_int(&c->req, 6, R);
    pb_int(&c->req, 7, V);
    pb_float(&c->req, 8, scale);
    int rc = cw_exchange(c, M_ATTENTION_RAGGED, out + (size_t)s0 * out_row,
                         (size_t)n * out_row * 4);
    if (rc) return rc;
    /* lengths: what the worker now holds, which must be what was asked */
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f;
    int k = 0, ok = 1;
    while (pb_next(&r, &f)) {
        if (f.field != 2) continue;
        if (f.wt == 0) {
            ok &= k < n && (int64_t)f.v == plan[s0 + k].len;
            k++;
        } else if (f.wt == 2) {
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            while (s.p < s.end) {
                uint64_t v = 0;
                int shift = 0;
                while (s.p < s.end) {
                    uint8_t b = *s.p++;
                    v |= (uint64_t)(b & 0x7f) << shift;
                    shift += 7;
                    if (!(b & 0x80)) break;
                }
                ok &= k < n && (int64_t)v == plan[s0 + k].len;
                k++;
            }
        }
    }
    if (!ok || k != n) {
        cw_log("attention_ragged: the worker holds other lengths than were sent");
        return CW_PROTO;
    }
    return 0;
}

int coli_cuda_attention_project_ragged(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                       const float *q, const void *const *keys,
                                       const float *const *latent, const float *const *rope,
                                       const int *lengths, int S, int H, int Q, int R, int V,
                                       int K, int T, float scale) {
    if (!w || !proj || !out || !q || !keys || !latent || !rope || !lengths || S < 1 || T < 1 ||
        H < 1 || Q < 1 || R < 1 || V < 1 || K < 1 || w->I != K ||
        (int64_t)w->O != (int64_t)H * (Q + V) || proj->w != w->w ||
        proj->device != w->device || (int64_t)proj->I != (int64_t)H * V)
        return 0;
    for (int s = 0; s < S; s++)
        if (!keys[s] || !latent[s] || !rope[s] || lengths[s] < 1 || lengths[s] > T) return 0;
    const void **sorted = malloc((size_t)S * sizeof *sorted);
    plan_row *plan = malloc((size_t)S * sizeof *plan);
    if (!sorted || !plan) { free(sorted); free(plan); return 0; }
    memcpy(sorted, keys, (size_t)S * sizeof *sorted);
    qsort(sorted, (size_t)S, sizeof *sorted, cmp_ptr);
    int dup = 0;
    for (int s = 1; s < S; s++) dup |= sorted[s] == sorted[s - 1];
    free(sorted);
    uint64_t hw = cw_handle(w), hp = cw_handle(proj);
    if (dup || !hw || !hp) { free(plan); return 0; }
    cw_conn *c = cw_acquire(w->w);
    if (!c) { free(plan); return 0; }
    int ok = 1, rc = 0;
    uint64_t epoch = cw_epoch_now(w->w);
    pthread_mutex_lock(&w->mu); /* ragged calls on one kv_b run one at a time */
    struct cw_seqtab *t = w->seqs;
    if (!t) t = w->seqs = calloc(1, sizeof *t);
    if (!t || !reserve(t, (size_t)S)) ok = 0;
    else t->calls++;
    for (int s = 0; s < S && ok; s++) {
        cw_seq *e = find(t, keys[s]);
        if (!e) e = insert(t, keys[s]);
        if (!fp_room(e, (size_t)lengths[s])) { ok = 0; break; }
        if (e->epoch != epoch) { e->epoch = epoch; e->len = 0; }
        if (e->len > 0 && (e->K != K || e->R != R)) { /* a new shape: a new sequence */
            free_sequence(c, e->id, hw);
            e->id = __atomic_add_fetch(&g_seq_ids, 1, __ATOMIC_RELAXED);
            e->len = 0;
        }
        e->K = K;
        e->R = R;
        e->last = t->calls;
        int64_t L = lengths[s], start = 0;
        for (int64_t j = (L < e->len ? L : e->len) - 1; j >= 0; j--)
            if (fingerprint(latent[s] + (size_t)j * K, K, rope[s] + (size_t)j * R, R) == e->fp[j]) {
                start = j + 1;
                break;
            }
        for (int64_t j = start; j < L; j++)
            e->fp[j] = fingerprint(latent[s] + (size_t)j * K, K, rope[s] + (size_t)j * R, R);
        if (e->len > start) e->len = start; /* only rows below start are known until the reply */
        plan[s].seq = e;
        plan[s].start = start;
        plan[s].len = L;
    }
    int step = w->w->max_seqs >= 1 && (int)w->w->max_seqs < S ? (int)w->w->max_seqs : S;
    for (int s0 = 0; s0 < S && ok; s0 += step) {
        int n = S - s0 < step ? S - s0 : step;
        rc = ragged_call(c, hw, hp, out, q, latent, rope, plan, s0, n, H, Q, R, V, K, scale,
                         (size_t)proj->O);
        if (rc == 9) { /* FAILED_PRECONDITION: the worker evicted one; all of them from 0 */
            for (int i = s0; i < s0 + n; i++) {
                plan[i].start = 0;
                plan[i].seq->len = 0;
                for (int64_t j = 0; j < plan[i].len; j++)
                    plan[i].seq->fp[j] = fingerprint(latent[i] + (size_t)j * K, K,
                                                     rope[i] + (size_t)j * R, R);
            }
            rc = ragged_call(c, hw, hp, out, q, latent, rope, plan, s0, n, H, Q, R, V, K, scale,
                             (size_t)proj->O);
        }
        if (rc == 0)
            for (int i = s0; i < s0 + n; i++) plan[i].seq->len = plan[i].len;
        else ok = 0;
    }
    if (t && (t->calls % 64 == 0 || t->n > (size_t)cw_cfg.seq_max)) sweep(t, c, hw, epoch);
    pthread_mutex_unlock(&w->mu);
    free(plan);
    if (!ok && rc == 0) rc = CW_PROTO;
    return cw_release(c, rc) && ok;
}
