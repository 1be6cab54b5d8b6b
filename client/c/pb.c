/* The proto3 subset the data plane's messages need: varints, length-delimited fields
 * (bytes, strings, nested messages, packed repeated ints) and fixed32 floats; a reader
 * that skips what it does not know. Field numbers are those of worker.proto. */
#include <stdlib.h>
#include <string.h>

#include "cw.h"

void pb_reset(pb_buf *b) { b->n = 0; b->oom = 0; }

void pb_release(pb_buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

static int room(pb_buf *b, size_t k) {
    if (b->oom) return 0;
    if (b->n + k <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + k) cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return 0; }
    b->p = p;
    b->cap = cap;
    return 1;
}

static int varint_len(uint64_t v) {
    int k = 1;
    while (v >= 0x80) { v >>= 7; k++; }
    return k;
}

static void put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) { *p++ = (uint8_t)(v | 0x80); v >>= 7; }
    *p = (uint8_t)v;
}

void pb_varint(pb_buf *b, uint64_t v) {
    if (!room(b, 10)) return;
    put_varint(b->p + b->n, v);
    b->n += (size_t)varint_len(v);
}

static void tag(pb_buf *b, int field, int wt) { pb_varint(b, (uint64_t)field << 3 | (uint64_t)wt); }

void pb_uint(pb_buf *b, int field, uint64_t v) { tag(b, field, 0); pb_varint(b, v); }

void pb_int(pb_buf *b, int field, int64_t v) { tag(b, field, 0); pb_varint(b, (uint64_t)v); }

void pb_bytes(pb_buf *b, int field, const void *p, size_t n) {
    tag(b, field, 2);
    pb_varint(b, n);
    if (n && room(b, n)) { memcpy(b->p + b->n, p, n); b->n += n; }
}

void pb_float(pb_buf *b, int field, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    tag(b, field, 5);
    if (!room(b, 4)) return;
    for (int i = 0; i < 4; i++) b->p[b->n++] = (uint8_t)(u >> (8 * i));
}

size_t pb_open(pb_buf *b, int field) {
    tag(b, field, 2);
    return b->n;
}

void pb_close(pb_buf *b, size_t start) {
    if (b->oom) return;
    size_t len = b->n - start;
    int k = varint_len(len);
    if (!room(b, (size_t)k)) return;
    memmove(b->p + start + k, b->p + start, len);
    put_varint(b->p + start, len);
    b->n += (size_t)k;
}

void pb_array(pb_buf *b, int field, const int64_t *shape, int nd, uint64_t off, uint64_t len) {
    size_t a = pb_open(b, field);
    pb_uint(b, 1, 1); /* DTYPE_FLOAT32 */
    size_t s = pb_open(b, 2);
    for (int i = 0; i < nd; i++) pb_varint(b, (uint64_t)shape[i]);
    pb_close(b, s);
    size_t st = pb_open(b, 5);
    if (off) pb_uint(b, 1, off);
    pb_uint(b, 2, len);
    pb_close(b, st);
    pb_close(b, a);
}

static int get_varint(pb_rd *r, uint64_t *v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return 0;
        uint8_t c = *r->p++;
        x |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) { *v = x; return 1; }
    }
    return 0;
}

int pb_next(pb_rd *r, pb_field *f) {
    uint64_t key;
    if (r->bad || r->p >= r->end) return 0;
    if (!get_varint(r, &key) || (key >> 3) == 0 || (key >> 3) > 0x1fffffff) goto bad;
    f->field = (int)(key >> 3);
    f->wt = (int)(key & 7);
    f->ptr = NULL;
    f->len = 0;
    f->v = 0;
    switch (f->wt) {
    case 0:
        if (!get_varint(r, &f->v)) goto bad;
        return 1;
    case 1:
        if (r->end - r->p < 8) goto bad;
        for (int i = 0; i < 8; i++) f->v |= (uint64_t)r->p[i] << (8 * i);
        r->p += 8;
        return 1;
    case 2: {
        uint64_t n;
        if (!get_varint(r, &n) || n > (uint64_t)(r->end - r->p)) goto bad;
        f->ptr = r->p;
        f->len = (size_t)n;
        r->p += n;
        return 1;
    }
    case 5:
        if (r->end - r->p < 4) goto bad;
        for (int i = 0; i < 4; i++) f->v |= (uint64_t)r->p[i] << (8 * i);
        r->p += 4;
        return 1;
    default:
        goto bad;
    }
bad:
    r->bad = 1;
    return 0;
}

int pb_read_array(const uint8_t *p, size_t n, pb_arr *a) {
    pb_rd r = {p, p + n, 0};
    pb_field f;
    memset(a, 0, sizeof *a);
    while (pb_next(&r, &f)) {
        if (f.field == 1 && f.wt == 0) a->dtype = (int)f.v;
        else if (f.field == 2 && f.wt == 0 && a->nd < 8) a->shape[a->nd++] = (int64_t)f.v;
        else if (f.field == 2 && f.wt == 2) {
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            uint64_t v;
            while (s.p < s.end) {
                if (!get_varint(&s, &v) || a->nd >= 8) return 0;
                a->shape[a->nd++] = (int64_t)v;
            }
        } else if (f.field == 3 && f.wt == 2) {
            a->data = f.ptr;
            a->data_len = f.len;
            a->has_data = f.len > 0;
        } else if (f.field == 5 && f.wt == 2) {
            pb_rd s = {f.ptr, f.ptr + f.len, 0};
            pb_field g;
            a->staged = 1;
            while (pb_next(&s, &g)) {
                if (g.field == 1 && g.wt == 0) a->off = g.v;
                else if (g.field == 2 && g.wt == 0) a->len = g.v;
            }
            if (s.bad) return 0;
        }
    }
    return !r.bad;
}
