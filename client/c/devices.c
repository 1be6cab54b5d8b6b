/* The engine's devices as the ABI reports them: the Info exchange (also the pools' check on
 * connect, workers.c), the device count and ids, memory, and the tensor and expert-group
 * stats summed over the workers (coli_cuda_device_*, coli_cuda_mem_info, coli_cuda_stats,
 * coli_cuda_group_stats).
 */
#include <string.h>

#include "cw.h"

int cw_info(cw_conn *c, cw_worker *w, cw_dev_info *devs, int *ndev) {
    cw_begin(c);
    int rc = cw_exchange(c, M_INFO, NULL, 0);
    if (rc) return rc;
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f, g;
    *ndev = 0;
    while (pb_next(&r, &f)) {
        if (f.field == 3 && f.wt == 2 && *ndev < COLI_CUDA_MAX_DEVICES) {
            cw_dev_info *d = &devs[(*ndev)++];
            memset(d, 0, sizeof *d);
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            while (pb_next(&s, &g)) {
                if (g.wt != 0) continue;
                if (g.field == 1) d->id = (int)(int32_t)g.v;
                else if (g.field == 3) d->total = g.v;
                else if (g.field == 4) d->free = g.v;
                else if (g.field == 5) d->limit = g.v;
            }
        } else if (f.field == 4 && f.wt == 2 && w) {
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            while (pb_next(&s, &g)) {
                if (g.wt != 0) continue;
                if (g.field == 1) w->max_experts = (uint32_t)g.v;
                else if (g.field == 5) w->max_seqs = (uint32_t)g.v;
                else if (g.field == 7) w->max_frame = g.v;
            }
        }
    }
    return r.bad ? CW_PROTO : 0;
}

int coli_cuda_device_count(void) { return cw_ndev; }

int coli_cuda_device_at(int index) {
    return index >= 0 && index < cw_ndev ? cw_devs[index].id : -1;
}

int coli_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
    cw_dev *d = cw_find_dev(device);
    if (!free_bytes || !total_bytes || !d) return 0;
    cw_conn *c = cw_acquire(d->w);
    if (!c) return 0;
    cw_dev_info devs[COLI_CUDA_MAX_DEVICES];
    int ndev = 0;
    int rc = cw_info(c, NULL, devs, &ndev);
    if (!cw_release(c, rc)) return 0;
    for (int i = 0; i < ndev; i++)
        if (devs[i].id == d->rdev) {
            uint64_t total = devs[i].total, free_ = devs[i].free;
            if (devs[i].limit && devs[i].limit < total) total = devs[i].limit;
            if (free_ > total) free_ = total;
            *free_bytes = (size_t)free_;
            *total_bytes = (size_t)total;
            return 1;
        }
    return 0;
}

/* -- stats ---------------------------------------------------------------------------- */

enum { S_TENSORS, S_BYTES, S_CALLS, S_EXPERTS, S_ROWS, S_H2D, S_KERNEL, S_D2H, S_N };

/* Stats of worker w: per worker device (by position in w->rdev) the figures above. */
static int worker_stats(cw_worker *w, uint64_t out[COLI_CUDA_MAX_DEVICES][S_N]) {
    memset(out, 0, sizeof(uint64_t) * COLI_CUDA_MAX_DEVICES * S_N);
    cw_conn *c = cw_acquire(w);
    if (!c) return 0;
    cw_begin(c);
    int rc = cw_exchange(c, M_STATS, NULL, 0);
    if (rc) return cw_release(c, rc);
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f, g, h;
    while (pb_next(&r, &f)) {
        if (f.field != 1 || f.wt != 2) continue;
        uint64_t v[S_N] = {0};
        int dev = 0; /* proto3 leaves a 0 out */
        pb_rd s = {f.ptr, f.ptr + f.len, 0};
        while (pb_next(&s, &g)) {
            if (g.field == 1 && g.wt == 0) dev = (int)(int32_t)g.v;
            else if (g.field == 2 && g.wt == 0) v[S_TENSORS] = g.v;
            else if (g.field == 3 && g.wt == 0) v[S_BYTES] = g.v;
            else if (g.field == 7 && g.wt == 2) {
                pb_rd t = {g.ptr, g.ptr + g.len, 0};
                while (pb_next(&t, &h))
                    if (h.wt == 0 && h.field >= 1 && h.field <= 6) v[S_CALLS + h.field - 1] = h.v;
            }
        }
        for (int i = 0; i < w->ndev; i++)
            if (w->rdev[i] == dev) memcpy(out[i], v, sizeof v);
    }
    return cw_release(c, r.bad ? CW_PROTO : 0);
}

static int engine_uses(cw_worker *w, int pos, int device) {
    int id = w->first + pos;
    for (int i = 0; i < cw_ndev; i++)
        if (cw_devs[i].id == id) return device < 0 || device == id;
    return 0;
}

void coli_cuda_stats(int device, size_t *tensor_count, size_t *tensor_bytes) {
    uint64_t count = 0, bytes = 0;
    uint64_t st[COLI_CUDA_MAX_DEVICES][S_N];
    for (int k = 0; k < cw_nworkers && cw_inited; k++) {
        cw_worker *w = &cw_workers[k];
        int any = 0;
        for (int i = 0; i < w->ndev; i++) any |= engine_uses(w, i, device);
        if (!any) continue;
        if (worker_stats(w, st)) {
            for (int i = 0; i < w->ndev; i++)
                if (engine_uses(w, i, device)) {
                    count += st[i][S_TENSORS];
                    bytes += st[i][S_BYTES];
                }
            continue;
        }
        /* unreachable: what this process knows it has there */
        pthread_mutex_lock(&w->reg_mu);
        for (ColiCudaTensor *t = w->tensors; t; t = t->next)
            if (cw_handle(t) && (device < 0 || t->device == device)) {
                count++;
                bytes += t->wbytes + t->sbytes;
            }
        pthread_mutex_unlock(&w->reg_mu);
    }
    if (tensor_count) *tensor_count = (size_t)count;
    if (tensor_bytes) *tensor_bytes = (size_t)bytes;
}

void coli_cuda_group_stats(uint64_t *calls, uint64_t *experts, uint64_t *rows, double *h2d_ms,
                           double *kernel_ms, double *d2h_ms) {
    uint64_t sum[6] = {0};
    uint64_t st[COLI_CUDA_MAX_DEVICES][S_N];
    for (int k = 0; k < cw_nworkers && cw_inited; k++) {
        cw_worker *w = &cw_workers[k];
        int any = 0;
        for (int i = 0; i < w->ndev; i++) any |= engine_uses(w, i, -1);
        if (!any) continue;
        int ok = worker_stats(w, st);
        pthread_mutex_lock(&w->reg_mu);
        if (ok) {
            memset(w->glast, 0, sizeof w->glast);
            for (int i = 0; i < w->ndev; i++)
                if (engine_uses(w, i, -1))
                    for (int j = 0; j < 6; j++) w->glast[j] += st[i][S_CALLS + j];
        }
        for (int j = 0; j < 6; j++) sum[j] += w->gbase[j] + w->glast[j];
        pthread_mutex_unlock(&w->reg_mu);
    }
    if (calls) *calls = sum[0];
    if (experts) *experts = sum[1];
    if (rows) *rows = sum[2];
    if (h2d_ms) *h2d_ms = (double)sum[3] / 1e6;
    if (kernel_ms) *kernel_ms = (double)sum[4] / 1e6;
    if (d2h_ms) *d2h_ms = (double)sum[5] / 1e6;
}
