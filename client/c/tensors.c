/* Resident tensors: upload (content hash first: a tensor the worker already holds is
 * never sent again), update, free, and the host copies COLIWORKER_RETAIN keeps so a
 * restarted worker gets its tensors back.
 *
 * A ColiCudaTensor is this process's record of one worker handle. Its handle is good
 * while its epoch is its worker's (a restart moves the epoch on); the record stays valid
 * for the engine after the host frees its buffers, as the seed's device copy does.
 */
#include <stdlib.h>
#include <string.h>

#include "cw.h"

size_t cw_row_bytes(int fmt, int I) {
    switch (fmt) {
    case 0: return (size_t)I * 4;
    case 1: return (size_t)I;
    case 2: case 4: return ((size_t)I + 1) / 2;
    case 3: return ((size_t)I + 3) / 4;
    default: return 0;
    }
}

size_t cw_scale_count(int fmt, int I, int O, int gs) {
    if (fmt == 0) return 0;
    if (fmt == 4) return (size_t)O * (((size_t)I + (size_t)gs - 1) / (size_t)gs);
    return (size_t)O;
}

uint64_t cw_handle(const ColiCudaTensor *t) {
    if (!t || !t->w) return 0;
    uint64_t e = __atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE);
    if (e != cw_epoch_now(t->w)) return 0;
    return __atomic_load_n(&t->handle, __ATOMIC_RELAXED);
}

static void spec(pb_buf *b, int field, const ColiCudaTensor *t) {
    size_t s = pb_open(b, field);
    pb_int(b, 1, t->fmt);
    pb_int(b, 2, t->I);
    pb_int(b, 3, t->O);
    pb_int(b, 4, t->gs);
    pb_int(b, 5, t->rdev);
    pb_close(b, s);
}

/* The handle field of the TensorInfo at `field` of the reply body (0 if absent). */
static uint64_t reply_handle(cw_conn *c, int field, int *found) {
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f, g;
    uint64_t h = 0;
    while (pb_next(&r, &f)) {
        if (found && f.field == 1 && f.wt == 0) *found = (int)f.v;
        if (f.field == field && f.wt == 2) {
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            while (pb_next(&s, &g))
                if (g.field == 1 && g.wt == 0) h = g.v;
        }
    }
    return h;
}

int cw_put(cw_conn *c, ColiCudaTensor *t, const void *w, const void *s, uint64_t *handle) {
    int found = 0;
    cw_begin(c);
    pb_bytes(&c->req, 1, t->hash, 32); /* LookupRequest */
    pb_int(&c->req, 2, t->rdev);
    pb_uint(&c->req, 3, 1);            /* acquire: a hit is a new reference */
    int rc = cw_exchange(c, M_LOOKUP, NULL, 0);
    if (rc) return rc;
    uint64_t h = reply_handle(c, 2, &found);
    if (found && h) { *handle = h; return 0; }
    cw_begin(c);
    spec(&c->req, 1, t); /* UploadHeader */
    pb_bytes(&c->req, 2, t->hash, 32);
    pb_uint(&c->req, 3, t->wbytes);
    pb_uint(&c->req, 4, t->sbytes);
    cw_append(c, w, t->wbytes);
    if (t->sbytes) cw_append(c, s, t->sbytes);
    rc = cw_exchange(c, M_UPLOAD, NULL, 0);
    if (rc) return rc;
    h = reply_handle(c, 1, NULL);
    if (!h) return CW_PROTO;
    *handle = h;
    return 0;
}

static int put_now(ColiCudaTensor *t, const void *w, const void *s) {
    uint64_t epoch = cw_epoch_now(t->w), h = 0;
    cw_conn *c = cw_acquire(t->w);
    if (!c) return 0;
    if (!cw_release(c, cw_put(c, t, w, s, &h))) return 0;
    __atomic_store_n(&t->handle, h, __ATOMIC_RELAXED);
    __atomic_store_n(&t->epoch, epoch, __ATOMIC_RELEASE);
    return 1;
}

static void keep_host_copy(ColiCudaTensor *t, const void *w, const void *s) {
    if (!cw_cfg.retain) return;
    if (!t->host) t->host = malloc(t->wbytes + t->sbytes + 1);
    if (!t->host) {
        cw_log("COLIWORKER_RETAIN: no memory for a %zu-byte host copy; this tensor will not "
               "survive a worker restart", t->wbytes + t->sbytes);
        return;
    }
    memcpy(t->host, w, t->wbytes);
    if (t->sbytes) memcpy(t->host + t->wbytes, s, t->sbytes);
}

int coli_cuda_tensor_upload_g(ColiCudaTensor **tensor, const void *weights, const float *scales,
                              int fmt, int I, int O, int device, int gs) {
    if (!tensor) return 0;
    ColiCudaTensor *t = *tensor;
    if (t) {
        /* The resident copy serves whatever the host did with its buffers since; a record
         * whose worker restarted is uploaded again when the engine hands the bytes. */
        if (t->fmt != fmt || t->I != I || t->O != O || t->device != device) return 0;
        if (cw_handle(t) || !weights || (fmt && !scales)) return 1;
        pthread_mutex_lock(&t->w->reg_mu);
        int ok = cw_handle(t) || put_now(t, weights, scales);
        if (ok && !t->host) keep_host_copy(t, weights, scales);
        pthread_mutex_unlock(&t->w->reg_mu);
        return ok;
    }
    cw_dev *d = cw_find_dev(device);
    if (!weights || I < 1 || O < 1 || !d || fmt < 0 || fmt > 4 || (fmt && !scales)) return 0;
    if (fmt == 4 && gs <= 0) gs = I; /* no group size: one scale per row, as the seed */
    if (fmt != 4) gs = 0;
    size_t rb = cw_row_bytes(fmt, I);
    if ((size_t)O > ((size_t)-1 >> 4) / rb) return 0;
    t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->fmt = fmt; t->I = I; t->O = O; t->gs = gs; t->device = device;
    t->w = d->w;
    t->rdev = d->rdev;
    t->wbytes = rb * (size_t)O;
    t->sbytes = 4 * cw_scale_count(fmt, I, O, gs);
    pthread_mutex_init(&t->mu, NULL);
    cw_content_hash(fmt, I, O, gs, weights, t->wbytes, scales, t->sbytes, t->hash);
    if (!put_now(t, weights, scales)) {
        pthread_mutex_destroy(&t->mu);
        free(t);
        return 0;
    }
    keep_host_copy(t, weights, scales);
    cw_worker *w = t->w;
    pthread_mutex_lock(&w->reg_mu);
    t->next = w->tensors;
    if (w->tensors) w->tensors->prev = t;
    w->tensors = t;
    pthread_mutex_unlock(&w->reg_mu);
    *tensor = t;
    return 1;
}

int coli_cuda_tensor_upload(ColiCudaTensor **tensor, const void *weights, const float *scales,
                            int fmt, int I, int O, int device) {
    return coli_cuda_tensor_upload_g(tensor, weights, scales, fmt, I, O, device, 0);
}

int coli_cuda_tensor_update(ColiCudaTensor *t, const void *weights, const float *scales) {
    if (!t || !weights || (t->fmt && !scales)) return 0;
    uint64_t h = cw_handle(t);
    if (!h) return 0;
    uint8_t hash[32];
    cw_content_hash(t->fmt, t->I, t->O, t->gs, weights, t->wbytes, scales, t->sbytes, hash);
    cw_conn *c = cw_acquire(t->w);
    if (!c) return 0;
    cw_begin(c);
    spec(&c->req, 1, t); /* UploadHeader with the handle to replace */
    pb_bytes(&c->req, 2, hash, 32);
    pb_uint(&c->req, 3, t->wbytes);
    pb_uint(&c->req, 4, t->sbytes);
    pb_uint(&c->req, 5, h);
    cw_append(c, weights, t->wbytes);
    if (t->sbytes) cw_append(c, scales, t->sbytes);
    if (!cw_release(c, cw_exchange(c, M_UPDATE, NULL, 0))) return 0;
    pthread_mutex_lock(&t->w->reg_mu);
    memcpy(t->hash, hash, 32);
    if (t->host) keep_host_copy(t, weights, scales);
    pthread_mutex_unlock(&t->w->reg_mu);
    return 1;
}

/* Drop a handle: now, or once the worker is reachable again when it is the same
 * instance (a restarted one holds nothing of the old). */
void cw_free_handle(cw_worker *w, uint64_t handle, uint64_t epoch) {
    cw_conn *c = cw_acquire(w);
    if (c) {
        cw_begin(c);
        pb_uint(&c->req, 1, handle);
        if (cw_release(c, cw_exchange(c, M_FREE, NULL, 0))) return;
    }
    pthread_mutex_lock(&w->reg_mu);
    if (epoch == cw_epoch_now(w)) {
        if (w->ndfree == w->capdfree) {
            size_t cap = w->capdfree ? 2 * w->capdfree : 64;
            uint64_t *p = realloc(w->dfree, cap * sizeof *p);
            if (p) { w->dfree = p; w->capdfree = cap; }
        }
        if (w->ndfree < w->capdfree) w->dfree[w->ndfree++] = handle;
    }
    pthread_mutex_unlock(&w->reg_mu);
}

void coli_cuda_tensor_free(ColiCudaTensor *t) {
    if (!t) return;
    cw_worker *w = t->w;
    pthread_mutex_lock(&w->reg_mu); /* waits for a restore in progress */
    if (t->prev) t->prev->next = t->next;
    else if (w->tensors == t) w->tensors = t->next;
    if (t->next) t->next->prev = t->prev;
    pthread_mutex_unlock(&w->reg_mu);
    pthread_mutex_lock(&t->mu); /* after a ragged call on it; its caches go with it */
    cw_seqtab_free(t->seqs);
    t->seqs = NULL;
    pthread_mutex_unlock(&t->mu);
    uint64_t epoch = __atomic_load_n(&t->epoch, __ATOMIC_ACQUIRE);
    uint64_t h = cw_handle(t);
    if (h && cw_inited) cw_free_handle(w, h, epoch);
    pthread_mutex_destroy(&t->mu);
    free(t->host);
    free(t);
}

size_t coli_cuda_tensor_bytes(const ColiCudaTensor *t) { return t ? t->wbytes + t->sbytes : 0; }

int coli_cuda_tensor_device(const ColiCudaTensor *t) { return t ? t->device : -1; }
