/* The worker's decode calls read and answered in C: the protobuf body of an expert group,
 * routed expert group or ragged attention call parsed straight from the frame, its checks
 * made, its arrays made as NumPy views of the frame's data, and the reply's body written,
 * with no protobuf message on either side
 * (server/fastpath.py builds and loads this module and owns the Python around it).
 *
 *   setup(Experts, list_cache_size)
 *   routed_args(body, data, owner, cache, triple_cache, generation, max_experts, shm_view)
 *       -> (triples, device, x, routes, weights) or None
 *       ``body`` a serialized ExpertGroupRoutedRequest, ``data`` the frame's data (the
 *       buffer its ``staged`` slices index), ``shm_view`` the session segment's ``view``
 *       (its ``shm`` slices; None without one); ``cache`` and ``triple_cache`` the
 *       servicer's expert-list and per-triple caches (``ExpertLists._expert_cache``,
 *       ``_triple_cache``), read by the keys ``ExpertLists._experts`` makes: a list not
 *       cached whose every triple is, for this generation, is made and cached as there.
 *   group_args(body, data, owner, cache, triple_cache, generation, max_experts, shm_view)
 *       -> (triples, device, rows, x) or None: the same for an expert group call (an
 *       ExpertGroupRequest: each expert's rows of x packed in turn), ``rows`` a list of ints.
 *   ragged_args(body, data, owner, cache, generation, max_sequences, shm_view, RowsIn)
 *       -> (kv_b, o_proj handle, o_proj resident, q, rows, new rows, K, q_dim, rope_dim,
 *           v_dim, scale, o_proj id) or None: the same for a ragged attention call, its
 *       (kv_b, o_proj) pair from ``ComputeOps._attention_cache``.
 *   ragged_reply(shape, nbytes, lengths, backend_ns, shm, offset) -> bytes
 *   group_reply(shape, nbytes, backend_ns, h2d_ns, kernel_ns, d2h_ns, shm, offset) -> bytes
 *       the ExpertGroupResponse whose ``y`` is a float32 array of ``shape`` at ``offset``,
 *       ``nbytes`` long, of the frame's data (``staged``) or of the segment (``shm``).
 *
 * ``routed_args``, ``group_args`` and ``ragged_args`` answer only a call the Python path would
 * run and whose
 * tensors the caches hold for this store generation: every field known and set once, the
 * activations float32, routes int32, each array's bytes inline, in the frame (staged) or,
 * float32, in the session's segment (shm, a read-only view as ``staging.source`` gives),
 * the result float32. For anything else they return None, having taken nothing, and the
 * caller runs the call as before (``ComputeOps.expert_group_routed``, ``expert_group``,
 * ``attention_ragged``):
 * that path stays the reference and the only author of every error.
 * tests/hotpath/test_fastpath_routed.py, test_fastpath_group.py and test_fastpath_ragged.py
 * run both paths on the same calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The most experts one call names that this file reads (a longer list: the Python). */
#define MAX_EXPERTS 1024
/* DType values (worker.proto) */
#define DT_FLOAT32 1
#define DT_INT32 5

typedef struct {
    const uint8_t *p, *end;
} reader;

/* One varint; 0 on success, -1 where it runs past the end or over 10 bytes. */
static int varint(reader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return -1;
        uint8_t b = *r->p++;
        if (shift == 63 && b > 1) return -1;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* A length-delimited field's bytes; 0 on success. */
static int span(reader *r, reader *sub) {
    uint64_t n;
    if (varint(r, &n) || n > (uint64_t)(r->end - r->p)) return -1;
    sub->p = r->p;
    sub->end = r->p + n;
    r->p += n;
    return 0;
}

/* An Array as this file takes it: its bytes in the body (``data``) or at a staged slice. */
typedef struct {
    int seen;
    uint64_t dtype;
    int ndim;
    int64_t shape[8];
    const uint8_t *inline_p; /* the data field, where non-empty */
    uint64_t inline_n;
    int staged, shm; /* the slice's buffer: the frame's data, or the shared segment */
    uint64_t offset, length;
} array_t;

static int parse_slice(reader *r, uint64_t *offset, uint64_t *length) {
    int seen_o = 0, seen_l = 0;
    while (r->p < r->end) {
        uint64_t tag;
        if (varint(r, &tag)) return -1;
        if (tag == 0x08 && !seen_o++) {
            if (varint(r, offset)) return -1;
        } else if (tag == 0x10 && !seen_l++) {
            if (varint(r, length)) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

static int shape_value(array_t *a, uint64_t d) {
    if (a->ndim >= 8 || d < 1 || d > 0x7fffffff) return -1; /* (>= 1: a shape the Python takes) */
    a->shape[a->ndim++] = (int64_t)d;
    return 0;
}

/* -1: not an Array this file reads (an unknown or repeated field, shared memory, ...). */
static int parse_array(reader *r, array_t *a) {
    int seen_dtype = 0, seen_data = 0, packed = 0, unpacked = 0;
    memset(a, 0, sizeof *a);
    a->seen = 1;
    while (r->p < r->end) {
        uint64_t tag;
        reader sub;
        if (varint(r, &tag)) return -1;
        switch (tag) {
        case 0x08: /* dtype */
            if (seen_dtype++ || varint(r, &a->dtype)) return -1;
            break;
        case 0x12: /* shape, packed */
            if (packed++ || unpacked || span(r, &sub)) return -1;
            while (sub.p < sub.end) {
                uint64_t d;
                if (varint(&sub, &d) || shape_value(a, d)) return -1;
            }
            break;
        case 0x10: /* shape, one value */
            {
                uint64_t d;
                unpacked = 1;
                if (packed || varint(r, &d) || shape_value(a, d)) return -1;
            }
            break;
        case 0x1a: /* data */
            if (seen_data++ || span(r, &sub)) return -1;
            a->inline_p = sub.p;
            a->inline_n = (uint64_t)(sub.end - sub.p);
            break;
        case 0x22: /* shm */
        case 0x2a: /* staged */
            /* (one slice: with both, the Python checks each and reads one: its call) */
            if (a->staged || a->shm || span(r, &sub) ||
                parse_slice(&sub, &a->offset, &a->length))
                return -1;
            if (tag == 0x22) a->shm = 1;
            else a->staged = 1;
            break;
        default:
            return -1;
        }
    }
    return 0;
}

typedef struct {
    Py_buffer body, data;
    int have_data;
    PyObject *body_obj, *data_obj;
    PyObject *shm_view; /* the segment's view(offset, length, field), or None */
    PyObject *field;    /* the call's kind: what a shm view is asked for */
} frame_t;

static PyObject *s_routed, *s_group, *s_ragged, *s_data, *s_spec, *s_in_features, *s_out_features;

static int frame_open(frame_t *f, PyObject *body, PyObject *data, PyObject *shm_view,
                      PyObject *field) {
    memset(f, 0, sizeof *f);
    f->field = field;
    f->body_obj = body;
    f->data_obj = data;
    f->shm_view = shm_view;
    if (PyObject_GetBuffer(body, &f->body, PyBUF_SIMPLE) < 0) return -1;
    if (data != Py_None) {
        if (PyObject_GetBuffer(data, &f->data, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&f->body);
            return -1;
        }
        f->have_data = 1;
    }
    return 0;
}

static void frame_close(frame_t *f) {
    PyBuffer_Release(&f->body);
    if (f->have_data) PyBuffer_Release(&f->data);
}

/* ``a`` a float32 (or int32) array of rank ``ndim`` whose bytes are all there: a NumPy view
 * of them (its base the buffer's owner), or NULL with no error set where it is not. */
static PyObject *view(frame_t *f, const array_t *a, uint64_t dtype, int typenum, int ndim) {
    if (!a->seen || a->dtype != dtype || a->ndim != ndim) return NULL;
    uint64_t want = 4u;
    for (int i = 0; i < ndim; i++) {
        if ((uint64_t)a->shape[i] > ((uint64_t)1 << 48) / want) return NULL; /* (no overflow) */
        want *= (uint64_t)a->shape[i];
    }
    const uint8_t *p;
    PyObject *base;
    int readonly;
    Py_buffer shm_buf;
    PyObject *shm_obj = NULL;
    if (a->inline_n) {
        /* (with a slice too, the Python checks the slice and reads the data: its call) */
        if (a->staged || a->shm || a->inline_n != want) return NULL;
        p = a->inline_p;
        base = f->body_obj;
        readonly = f->body.readonly;
    } else if (a->shm) {
        /* float32 only: the Python copies an integer array out of the segment */
        if (f->shm_view == Py_None || dtype != DT_FLOAT32 || a->length != want) return NULL;
        shm_obj = PyObject_CallFunction(f->shm_view, "KKO", (unsigned long long)a->offset,
                                        (unsigned long long)a->length, f->field);
        if (shm_obj == NULL) { /* outside the segment, detached: the Python's error */
            PyErr_Clear();
            return NULL;
        }
        if (PyObject_GetBuffer(shm_obj, &shm_buf, PyBUF_SIMPLE) < 0) {
            Py_DECREF(shm_obj);
            return NULL;
        }
        p = (const uint8_t *)shm_buf.buf;
        readonly = shm_buf.readonly;
        int short_view = (uint64_t)shm_buf.len != want;
        PyBuffer_Release(&shm_buf); /* (the view object keeps the mapping) */
        if (short_view) {
            Py_DECREF(shm_obj);
            return NULL;
        }
        base = shm_obj;
    } else if (a->staged) {
        if (!f->have_data || a->offset > (uint64_t)f->data.len ||
            a->length > (uint64_t)f->data.len - a->offset || a->length != want)
            return NULL;
        p = (const uint8_t *)f->data.buf + a->offset;
        base = f->data_obj;
        readonly = f->data.readonly;
    } else {
        return NULL;
    }
    npy_intp dims[8];
    for (int i = 0; i < ndim; i++) dims[i] = (npy_intp)a->shape[i];
    int flags = NPY_ARRAY_C_CONTIGUOUS;
    if (!readonly) flags |= NPY_ARRAY_WRITEABLE;
    if (((uintptr_t)p & 3u) == 0) flags |= NPY_ARRAY_ALIGNED;
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(typenum), ndim,
                                         dims, NULL, (void *)p, flags, NULL);
    if (arr == NULL) {
        Py_XDECREF(shm_obj);
        return NULL;
    }
    PyArray_UpdateFlags((PyArrayObject *)arr, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS);
    /* the base keeps the buffer: a new reference (the shm view's own, passed on) */
    if (PyArray_SetBaseObject((PyArrayObject *)arr, shm_obj ? shm_obj : Py_NewRef(base)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static void put_varint(uint8_t **w, uint64_t v) {
    while (v >= 0x80) {
        *(*w)++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *(*w)++ = (uint8_t)v;
}

/* One Expert message as protobuf serializes it (fields in order, zeros left out). */
static size_t expert_bytes(uint8_t *w0, const uint64_t ids[3]) {
    uint8_t inner[33], *w = inner;
    for (int k = 0; k < 3; k++) {
        if (ids[k]) {
            *w++ = (uint8_t)(0x08 + 8 * k);
            put_varint(&w, ids[k]);
        }
    }
    size_t n = (size_t)(w - inner);
    w0[0] = 0x0a;
    w0[1] = (uint8_t)n;
    memcpy(w0 + 2, inner, n);
    return n + 2;
}

static int parse_expert(reader *r, uint64_t ids[3]) {
    ids[0] = ids[1] = ids[2] = 0;
    while (r->p < r->end) {
        uint64_t tag;
        if (varint(r, &tag)) return -1;
        if (tag != 0x08 && tag != 0x10 && tag != 0x18) return -1;
        if (varint(r, &ids[(tag >> 3) - 1])) return -1; /* a repeat: the last wins, as there */
    }
    return 0;
}

/* The experts of a call as protobuf serializes them (``buf``: each a 0x0A tag, its length and
 * its ids), and ``size``, the length of each where all are of one length and the call has
 * arrays outside its message (``ExpertLists._experts`` keys its caches by these bytes then,
 * ``_expert_run``), else 0 (keyed by the ids). */
typedef struct {
    uint8_t buf[MAX_EXPERTS * 35];
    size_t size;
} canon_t;

static void canon(canon_t *k, uint64_t (*ids)[3], Py_ssize_t n, int external) {
    k->size = 0;
    if (!external) return;
    uint8_t *w = k->buf;
    size_t first = 0;
    for (Py_ssize_t c = 0; c < n; c++) {
        size_t len = expert_bytes(w, ids[c]);
        if (c == 0) first = len;
        else if (len != first) return;
        w += len;
    }
    k->size = first;
}

/* The list's key: (owner, the experts' bytes), or (owner, g0, u0, d0, g1, ...). */
static PyObject *list_key(PyObject *owner, uint64_t (*ids)[3], Py_ssize_t n, const canon_t *k) {
    if (k->size) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)k->buf, (Py_ssize_t)(k->size * n));
        if (b == NULL) return NULL;
        PyObject *key = PyTuple_Pack(2, owner, b);
        Py_DECREF(b);
        return key;
    }
    PyObject *key = PyTuple_New(1 + 3 * n);
    if (key == NULL) return NULL;
    PyTuple_SET_ITEM(key, 0, Py_NewRef(owner));
    for (Py_ssize_t c = 0; c < n; c++) {
        for (int j = 0; j < 3; j++) {
            PyObject *v = PyLong_FromUnsignedLongLong(ids[c][j]);
            if (v == NULL) {
                Py_DECREF(key);
                return NULL;
            }
            PyTuple_SET_ITEM(key, 1 + 3 * c + j, v);
        }
    }
    return key;
}

/* Expert ``c``'s key in the per-triple cache: (owner, its bytes) or (owner, (g, u, d)). */
static PyObject *triple_key(PyObject *owner, uint64_t (*ids)[3], Py_ssize_t c, const canon_t *k) {
    if (k->size)
        return Py_BuildValue("(Oy#)", owner, (const char *)k->buf + k->size * c,
                             (Py_ssize_t)k->size);
    return Py_BuildValue("(O(KKK))", owner, (unsigned long long)ids[c][0],
                         (unsigned long long)ids[c][1], (unsigned long long)ids[c][2]);
}

/* ``cache[key]`` where it is a tuple of ``size`` made for this store generation (its first
 * item ``gen``): borrowed; else NULL, with an error set only where a lookup raised. */
static PyObject *cached(PyObject *cache, PyObject *key, PyObject *gen, Py_ssize_t size) {
    PyObject *hit = PyDict_GetItemWithError(cache, key);
    if (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != size) return NULL;
    int fresh = PyObject_RichCompareBool(PyTuple_GET_ITEM(hit, 0), gen, Py_EQ);
    return fresh > 0 ? hit : NULL;
}

static PyObject *experts_cls;    /* compute.Experts */
static Py_ssize_t list_limit;    /* compute._EXPERT_CACHE */
static PyObject *s_ids;

static PyObject *setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "setup(Experts, list cache size)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit < 0 && PyErr_Occurred()) return NULL;
    Py_XSETREF(experts_cls, Py_NewRef(args[0]));
    list_limit = limit;
    Py_RETURN_NONE;
}

/* A list not in the list cache made of the per-triple cache's entries, as ``_experts``
 * makes it where each triple is there for this generation, on one device, of one D: the
 * cache's new entry (borrowed), or NULL (no error: a triple missing, the Python's). */
static PyObject *list_of_triples(PyObject *owner, uint64_t (*ids)[3], Py_ssize_t n,
                                 const canon_t *k, PyObject *cache, PyObject *triple_cache,
                                 PyObject *gen, PyObject *key) {
    if (experts_cls == NULL) return NULL; /* (setup not called: the Python's) */
    PyObject *triples = PyObject_CallNoArgs(experts_cls), *id_t = PyTuple_New(n);
    PyObject *device = NULL, *dim = NULL, *entry = NULL;
    if (triples == NULL || id_t == NULL) goto out;
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *tk = triple_key(owner, ids, c, k);
        if (tk == NULL) goto out;
        PyObject *th = cached(triple_cache, tk, gen, 5);
        Py_DECREF(tk);
        if (th == NULL) goto out;
        if (c == 0) {
            device = PyTuple_GET_ITEM(th, 2);
            dim = PyTuple_GET_ITEM(th, 3);
        } else {
            int d1 = PyObject_RichCompareBool(PyTuple_GET_ITEM(th, 3), dim, Py_EQ);
            if (d1 <= 0) goto out;
            int d2 = PyObject_RichCompareBool(PyTuple_GET_ITEM(th, 2), device, Py_EQ);
            if (d2 <= 0) goto out;
        }
        if (PyList_Append(triples, PyTuple_GET_ITEM(th, 1)) < 0) goto out;
        PyTuple_SET_ITEM(id_t, c, Py_NewRef(PyTuple_GET_ITEM(th, 4)));
    }
    if (PyObject_SetAttr(triples, s_ids, id_t) < 0) goto out;
    if (PyDict_GET_SIZE(cache) >= list_limit) PyDict_Clear(cache);
    PyObject *value = PyTuple_Pack(4, gen, triples, device, dim);
    if (value == NULL) goto out;
    if (PyDict_SetItem(cache, key, value) == 0) entry = value; /* (the dict holds it) */
    Py_DECREF(value);
out:
    Py_XDECREF(triples);
    Py_XDECREF(id_t);
    return entry;
}

/* The call's expert list as ``ExpertLists._experts`` finds it: the list cache's entry for
 * this owner, experts and store generation, or one made of the per-triple cache's entries
 * (``list_of_triples``), keyed by the experts' bytes where ``external`` (an array outside
 * the message) and all serialize to one length, else by their ids. On success 1, with new
 * references to the entry's triples and device (``Experts`` and an int) and its hidden size
 * in ``dim``; 0 where the caches do not hold it (the Python's), -1 with an error set. (New
 * references: the dict may be cleared by another thread once a view calls into Python.) */
static int find_list(PyObject *owner, uint64_t (*ids)[3], Py_ssize_t n, int external,
                     PyObject *cache, PyObject *triple_cache, PyObject *gen, PyObject **triples,
                     PyObject **device, long *dim) {
    canon_t k;
    canon(&k, ids, n, external);
    PyObject *key = list_key(owner, ids, n, &k);
    if (key == NULL) return -1;
    PyObject *hit = cached(cache, key, gen, 4);
    if (hit == NULL && !PyErr_Occurred()) /* a new list of known experts */
        hit = list_of_triples(owner, ids, n, &k, cache, triple_cache, gen, key);
    Py_DECREF(key);
    if (hit == NULL) return PyErr_Occurred() ? -1 : 0;
    *dim = PyLong_AsLong(PyTuple_GET_ITEM(hit, 3));
    if (*dim == -1 && PyErr_Occurred()) return -1;
    Py_ssize_t len = PyObject_Length(PyTuple_GET_ITEM(hit, 1));
    if (len != n) return len < 0 ? -1 : 0;
    *triples = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
    *device = Py_NewRef(PyTuple_GET_ITEM(hit, 2));
    return 1;
}

/* What ``routed_args`` and ``group_args`` take: (body, data, owner, cache, triple_cache,
 * generation, max_experts, shm_view), the frame opened into ``f`` for ``field``; -1 with an
 * error set (and ``f`` not open). */
typedef struct {
    PyObject *owner, *cache, *triple_cache, *gen;
    Py_ssize_t max_experts;
} group_in_t;

static int group_in(group_in_t *g, frame_t *f, PyObject *const *args, Py_ssize_t nargs,
                    const char *fn, PyObject *field) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "%s(body, data, owner, cache, triple_cache, generation, "
                                      "max_experts, shm_view)", fn);
        return -1;
    }
    g->owner = args[2];
    g->cache = args[3];
    g->triple_cache = args[4];
    g->gen = args[5];
    g->max_experts = PyLong_AsSsize_t(args[6]);
    if (g->max_experts < 0 && PyErr_Occurred()) return -1;
    if (!PyDict_Check(g->cache) || !PyDict_Check(g->triple_cache)) {
        PyErr_Format(PyExc_TypeError, "%s: cache and triple_cache must be dicts", fn);
        return -1;
    }
    return frame_open(f, args[0], args[1], args[7], field);
}

static PyObject *routed_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    group_in_t in;
    frame_t f;
    if (group_in(&in, &f, args, nargs, "routed_args", s_routed) < 0) return NULL;
    PyObject *result = NULL, *x = NULL, *routes = NULL, *weights = NULL;
    PyObject *triples = NULL, *device = NULL;
    uint64_t ids_of[MAX_EXPERTS][3];
    array_t ax = {0}, ar = {0}, aw = {0};
    Py_ssize_t n = 0;
    uint64_t out_dtype = 0;
    int seen_out = 0;
    long dim = 0;
    reader r = {(const uint8_t *)f.body.buf, (const uint8_t *)f.body.buf + f.body.len};
    while (r.p < r.end) {
        uint64_t tag;
        reader sub;
        if (varint(&r, &tag)) goto fallback;
        switch (tag) {
        case 0x0a: /* experts */
            if (n >= MAX_EXPERTS || span(&r, &sub) || parse_expert(&sub, ids_of[n])) goto fallback;
            n++;
            break;
        case 0x12: /* x */
            if (ax.seen || span(&r, &sub) || parse_array(&sub, &ax)) goto fallback;
            break;
        case 0x1a: /* routes */
            if (ar.seen || span(&r, &sub) || parse_array(&sub, &ar)) goto fallback;
            break;
        case 0x22: /* weights */
            if (aw.seen || span(&r, &sub) || parse_array(&sub, &aw)) goto fallback;
            break;
        case 0x28: /* output_dtype */
            if (seen_out++ || varint(&r, &out_dtype)) goto fallback;
            break;
        default:
            goto fallback;
        }
    }
    /* the result float32 (output_dtype or x's type), experts within the limit */
    if ((out_dtype != 0 && out_dtype != DT_FLOAT32) || n < 1 || n > in.max_experts) goto fallback;
    int external = ax.staged || ar.staged || aw.staged || ax.shm || ar.shm || aw.shm;
    int found = find_list(in.owner, ids_of, n, external, in.cache, in.triple_cache, in.gen,
                          &triples, &device, &dim);
    if (found < 0) goto error;
    if (found == 0) goto fallback;
    /* shapes: x [T, D], routes and weights [T, K], every route an index into experts */
    if (ax.ndim != 2 || ax.shape[1] != dim || ar.ndim != 2 || ar.shape[0] != ax.shape[0] ||
        aw.ndim != 2 || aw.shape[0] != ar.shape[0] || aw.shape[1] != ar.shape[1])
        goto fallback;
    x = view(&f, &ax, DT_FLOAT32, NPY_FLOAT32, 2);
    if (x == NULL) goto check;
    routes = view(&f, &ar, DT_INT32, NPY_INT32, 2);
    if (routes == NULL) goto check;
    weights = view(&f, &aw, DT_FLOAT32, NPY_FLOAT32, 2);
    if (weights == NULL) goto check;
    {
        const uint8_t *p = (const uint8_t *)PyArray_DATA((PyArrayObject *)routes);
        npy_intp count = PyArray_SIZE((PyArrayObject *)routes);
        for (npy_intp i = 0; i < count; i++) {
            int32_t v;
            memcpy(&v, p + 4 * i, 4);
            if (v < 0 || v >= n) goto fallback;
        }
    }
    result = PyTuple_Pack(5, triples, device, x, routes, weights);
    goto done;
check:
    if (PyErr_Occurred()) goto error;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(triples);
    Py_XDECREF(device);
    Py_XDECREF(x);
    Py_XDECREF(routes);
    Py_XDECREF(weights);
    frame_close(&f);
    return result;
}

/* A repeated int32 field's value as this file takes it: rows >= 1 (what the Python takes) */
static int row_value(uint64_t v, int64_t *rows, Py_ssize_t *nrows) {
    if (*nrows >= MAX_EXPERTS || v < 1 || v >= 0x80000000u) return -1;
    rows[(*nrows)++] = (int64_t)v;
    return 0;
}

static PyObject *group_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    group_in_t in;
    frame_t f;
    if (group_in(&in, &f, args, nargs, "group_args", s_group) < 0) return NULL;
    PyObject *result = NULL, *x = NULL, *rows = NULL, *triples = NULL, *device = NULL;
    uint64_t ids_of[MAX_EXPERTS][3];
    int64_t rows_of_e[MAX_EXPERTS];
    array_t ax = {0};
    Py_ssize_t n = 0, nrows = 0;
    uint64_t out_dtype = 0;
    int seen_out = 0;
    long dim = 0;
    reader r = {(const uint8_t *)f.body.buf, (const uint8_t *)f.body.buf + f.body.len};
    while (r.p < r.end) {
        uint64_t tag, v;
        reader sub;
        if (varint(&r, &tag)) goto fallback;
        switch (tag) {
        case 0x0a: /* experts */
            if (n >= MAX_EXPERTS || span(&r, &sub) || parse_expert(&sub, ids_of[n])) goto fallback;
            n++;
            break;
        case 0x12: /* rows, packed (protobuf appends each packed run, and single values) */
            if (span(&r, &sub)) goto fallback;
            while (sub.p < sub.end)
                if (varint(&sub, &v) || row_value(v, rows_of_e, &nrows)) goto fallback;
            break;
        case 0x10: /* rows, one value */
            if (varint(&r, &v) || row_value(v, rows_of_e, &nrows)) goto fallback;
            break;
        case 0x1a: /* x */
            if (ax.seen || span(&r, &sub) || parse_array(&sub, &ax)) goto fallback;
            break;
        case 0x20: /* output_dtype */
            if (seen_out++ || varint(&r, &out_dtype)) goto fallback;
            break;
        default:
            goto fallback;
        }
    }
    /* the result float32, experts within the limit, one rows entry per expert */
    if ((out_dtype != 0 && out_dtype != DT_FLOAT32) || n < 1 || n > in.max_experts || nrows != n)
        goto fallback;
    int found = find_list(in.owner, ids_of, n, ax.staged || ax.shm, in.cache, in.triple_cache,
                          in.gen, &triples, &device, &dim);
    if (found < 0) goto error;
    if (found == 0) goto fallback;
    /* x [sum(rows), D] */
    int64_t total = 0;
    for (Py_ssize_t c = 0; c < n; c++) total += rows_of_e[c];
    if (ax.ndim != 2 || ax.shape[0] != total || ax.shape[1] != dim) goto fallback;
    x = view(&f, &ax, DT_FLOAT32, NPY_FLOAT32, 2);
    if (x == NULL) goto check;
    rows = PyList_New(n);
    if (rows == NULL) goto error;
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *v = PyLong_FromLongLong(rows_of_e[c]);
        if (v == NULL) goto error;
        PyList_SET_ITEM(rows, c, v);
    }
    result = PyTuple_Pack(4, triples, device, rows, x);
    goto done;
check:
    if (PyErr_Occurred()) goto error;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(triples);
    Py_XDECREF(device);
    Py_XDECREF(x);
    Py_XDECREF(rows);
    frame_close(&f);
    return result;
}

/* The most sequences one ragged call has that this file reads (more: the Python). */
#define MAX_SEQUENCES 1024

/* An int attribute path of a Python object: obj.a.b.c (each name interned); -1 on error. */
static long long attr3(PyObject *obj, PyObject *a, PyObject *b, PyObject *c) {
    PyObject *x = PyObject_GetAttr(obj, a), *y, *z;
    if (x == NULL) return -1;
    y = PyObject_GetAttr(x, b);
    Py_DECREF(x);
    if (y == NULL) return -1;
    z = PyObject_GetAttr(y, c);
    Py_DECREF(y);
    if (z == NULL) return -1;
    long long v = PyLong_AsLongLong(z);
    Py_DECREF(z);
    return v;
}

/* A decode step's rows of one sequence: ``decode_rows`` of ``a``, [n, width] float32 where
 * the Array is wholly empty ([0, width] zeros); NULL with no error where this file does not
 * read it. */
static PyObject *rows_of(frame_t *f, const array_t *a, long long width) {
    if (!a->seen || (a->ndim == 0 && !a->inline_n && !a->staged && !a->shm && !a->dtype)) {
        npy_intp dims[2] = {0, (npy_intp)width};
        return PyArray_ZEROS(2, dims, NPY_FLOAT32, 0);
    }
    if (a->ndim != 2 || a->shape[1] != width) return NULL;
    return view(f, a, DT_FLOAT32, NPY_FLOAT32, 2);
}

/* An int32 field of a message (1 <= v < 2^31: what this file takes); -1 outside. */
static long long positive_int32(uint64_t v) { return v >= 1 && v < 0x80000000u ? (long long)v : -1; }

static PyObject *ragged_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "ragged_args(body, data, owner, cache, generation, "
                                         "max_sequences, shm_view, rows_in)");
        return NULL;
    }
    PyObject *owner = args[2], *cache = args[3], *gen = args[4], *rows_in = args[7];
    Py_ssize_t max_sequences = PyLong_AsSsize_t(args[5]);
    if (max_sequences < 0 && PyErr_Occurred()) return NULL;
    if (!PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "ragged_args: cache must be a dict");
        return NULL;
    }
    frame_t f;
    if (frame_open(&f, args[0], args[1], args[6], s_ragged) < 0) return NULL;
    PyObject *result = NULL, *key = NULL, *q = NULL, *rows = NULL, *fresh = NULL;
    array_t aq = {0};
    reader seqs[MAX_SEQUENCES];
    Py_ssize_t n = 0;
    uint64_t kv_id = 0, o_proj = 0, dims[3] = {0, 0, 0}, out_dtype = 0;
    uint32_t scale_bits = 0;
    unsigned seen = 0; /* a bit per scalar field number */
    reader r = {(const uint8_t *)f.body.buf, (const uint8_t *)f.body.buf + f.body.len};
    while (r.p < r.end) {
        uint64_t tag;
        if (varint(&r, &tag)) goto fallback;
        unsigned field = (unsigned)(tag >> 3);
        if (field != 3 && field != 4 && field < 10) {
            if (seen & (1u << field)) goto fallback; /* (set twice: the Python's) */
            seen |= 1u << field;
        }
        switch (tag) {
        case 0x08:
            if (varint(&r, &kv_id)) goto fallback;
            break;
        case 0x10:
            if (varint(&r, &o_proj)) goto fallback;
            break;
        case 0x1a: {
            reader sub;
            if (aq.seen || span(&r, &sub) || parse_array(&sub, &aq)) goto fallback;
            break;
        }
        case 0x22:
            if (n >= MAX_SEQUENCES || span(&r, &seqs[n])) goto fallback;
            n++;
            break;
        case 0x28:
        case 0x30:
        case 0x38:
            if (varint(&r, &dims[field - 5])) goto fallback;
            break;
        case 0x45:
            if (r.end - r.p < 4) goto fallback;
            memcpy(&scale_bits, r.p, 4);
            r.p += 4;
            break;
        case 0x48:
            if (varint(&r, &out_dtype)) goto fallback;
            break;
        default:
            goto fallback;
        }
    }
    long long q_dim = positive_int32(dims[0]), rope_dim = positive_int32(dims[1]),
              v_dim = positive_int32(dims[2]);
    float scale;
    memcpy(&scale, &scale_bits, 4);
    if ((out_dtype != 0 && out_dtype != DT_FLOAT32) || q_dim < 0 || rope_dim < 0 || v_dim < 0 ||
        !isfinite(scale) || scale == 0.0f || aq.ndim != 3 || aq.shape[0] != n ||
        n > max_sequences || aq.shape[2] != q_dim + rope_dim)
        goto fallback;
    /* kv_b and o_proj as an earlier call of this owner resolved them (_attention_cache) */
    key = Py_BuildValue("(OKK)", owner, (unsigned long long)kv_id, (unsigned long long)o_proj);
    if (key == NULL) goto error;
    PyObject *hit = cached(cache, key, gen, 4);
    if (hit == NULL) goto check;
    PyObject *kv_b = PyTuple_GET_ITEM(hit, 1), *proj_h = PyTuple_GET_ITEM(hit, 2),
             *proj = PyTuple_GET_ITEM(hit, 3);
    long long heads = aq.shape[1];
    long long out_features = attr3(kv_b, s_data, s_spec, s_out_features);
    if (out_features == -1 && PyErr_Occurred()) goto error;
    long long k = attr3(kv_b, s_data, s_spec, s_in_features);
    if (k == -1 && PyErr_Occurred()) goto error;
    if (out_features != heads * (q_dim + v_dim)) goto fallback;
    if (proj_h != Py_None) {
        long long in_features = attr3(proj_h, s_data, s_spec, s_in_features);
        if (in_features == -1 && PyErr_Occurred()) goto error;
        if (in_features != heads * v_dim) goto fallback;
    }
    q = view(&f, &aq, DT_FLOAT32, NPY_FLOAT32, 3);
    if (q == NULL) goto check;
    rows = PyList_New(n);
    fresh = PyList_New(n);
    if (rows == NULL || fresh == NULL) goto error;
    uint64_t ids[MAX_SEQUENCES];
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t sid = 0, start = 0;
        int seen_sid = 0, seen_start = 0;
        array_t al = {0}, ar = {0};
        reader sr = seqs[i];
        while (sr.p < sr.end) {
            uint64_t tag;
            reader sub;
            if (varint(&sr, &tag)) goto fallback;
            if (tag == 0x08 && !seen_sid++) {
                if (varint(&sr, &sid)) goto fallback;
            } else if (tag == 0x10 && !seen_start++) {
                if (varint(&sr, &start)) goto fallback;
            } else if (tag == 0x1a && !al.seen) {
                if (span(&sr, &sub) || parse_array(&sub, &al)) goto fallback;
            } else if (tag == 0x22 && !ar.seen) {
                if (span(&sr, &sub) || parse_array(&sub, &ar)) goto fallback;
            } else {
                goto fallback;
            }
        }
        if (start >> 63) goto fallback; /* start < 0 */
        for (Py_ssize_t j = 0; j < i; j++)
            if (ids[j] == sid) goto fallback; /* a sequence twice */
        ids[i] = sid;
        PyObject *lat = rows_of(&f, &al, k);
        if (lat == NULL) goto check;
        PyObject *rop = rows_of(&f, &ar, rope_dim);
        if (rop == NULL) {
            Py_DECREF(lat);
            goto check;
        }
        if (PyArray_DIM((PyArrayObject *)lat, 0) != PyArray_DIM((PyArrayObject *)rop, 0)) {
            Py_DECREF(lat);
            Py_DECREF(rop);
            goto fallback;
        }
        PyObject *pair = PyTuple_Pack(2, lat, rop);
        PyObject *one = pair ? PyObject_CallFunction(rows_in, "KLOO", (unsigned long long)sid,
                                                     (long long)start, lat, rop)
                             : NULL;
        Py_DECREF(lat);
        Py_DECREF(rop);
        if (one == NULL) {
            Py_XDECREF(pair);
            goto error;
        }
        PyList_SET_ITEM(rows, i, one);
        PyList_SET_ITEM(fresh, i, pair);
    }
    result = Py_BuildValue("(OOOOOOLLLLdK)", kv_b, proj_h, proj, q, rows, fresh, k, q_dim,
                           rope_dim, v_dim, (double)scale, (unsigned long long)o_proj);
    goto done;
check:
    if (PyErr_Occurred()) goto error;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(key);
    Py_XDECREF(q);
    Py_XDECREF(rows);
    Py_XDECREF(fresh);
    frame_close(&f);
    return result;
}

/* A float32 Array of ``shape`` whose ``nbytes`` lie at ``offset`` of the frame's data
 * (``staged``) or of the segment (``shm``), as protobuf serializes it, into ``w``; its end.
 * (The buffer: 2 + 1 + 8 x 10 + 1 + 1 + 22 bytes at most.) */
static uint8_t *put_array(uint8_t *w, PyObject *shape, uint64_t nbytes, int shm,
                          uint64_t offset) {
    uint8_t dims[8 * 10], *d = dims, slice[24], *q = slice;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (v == -1 && PyErr_Occurred()) return NULL;
        put_varint(&d, (uint64_t)v);
    }
    if (offset) {
        *q++ = 0x08;
        put_varint(&q, offset);
    }
    if (nbytes) {
        *q++ = 0x10;
        put_varint(&q, nbytes);
    }
    *w++ = 0x08; /* dtype: float32 */
    *w++ = DT_FLOAT32;
    if (d > dims) {
        *w++ = 0x12;
        put_varint(&w, (uint64_t)(d - dims));
        memcpy(w, dims, (size_t)(d - dims));
        w += d - dims;
    }
    *w++ = shm ? 0x22 : 0x2a;
    put_varint(&w, (uint64_t)(q - slice));
    memcpy(w, slice, (size_t)(q - slice));
    return w + (q - slice);
}

/* ``args[i]`` as a uint64, into ``out``; -1 with the error set. */
static int u64(PyObject *const *args, int i, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(args[i]);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

static int shape_arg(PyObject *shape, const char *fn) {
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) <= 8) return 0;
    PyErr_Format(PyExc_TypeError, "%s: shape must be a tuple of <= 8 ints", fn);
    return -1;
}

static PyObject *group_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "group_reply(shape, nbytes, backend_ns, h2d_ns, "
                                         "kernel_ns, d2h_ns, shm, offset)");
        return NULL;
    }
    uint64_t v[7]; /* nbytes, the four times, shm, offset */
    if (shape_arg(args[0], "group_reply")) return NULL;
    for (int i = 0; i < 7; i++)
        if (u64(args, 1 + i, &v[i])) return NULL;
    uint8_t arr[128], out[200], *w;
    uint8_t *end = put_array(arr, args[0], v[0], (int)v[5], v[6]);
    if (end == NULL) return NULL;
    w = out;
    *w++ = 0x0a; /* y */
    put_varint(&w, (uint64_t)(end - arr));
    memcpy(w, arr, (size_t)(end - arr));
    w += end - arr;
    for (int k = 0; k < 4; k++) { /* backend_ns, h2d_ns, kernel_ns, d2h_ns */
        if (v[1 + k]) {
            *w++ = (uint8_t)(0x10 + 8 * k);
            put_varint(&w, v[1 + k]);
        }
    }
    return PyBytes_FromStringAndSize((const char *)out, w - out);
}

static PyObject *ragged_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "ragged_reply(shape, nbytes, lengths: list, backend_ns, shm, offset)");
        return NULL;
    }
    uint64_t nbytes, backend_ns, shm, offset;
    if (shape_arg(args[0], "ragged_reply") || u64(args, 1, &nbytes) ||
        u64(args, 3, &backend_ns) || u64(args, 4, &shm) || u64(args, 5, &offset))
        return NULL;
    PyObject *lengths = args[2];
    Py_ssize_t n = PyList_GET_SIZE(lengths);
    uint8_t arr[128];
    uint8_t *end = put_array(arr, args[0], nbytes, (int)shm, offset);
    if (end == NULL) return NULL;
    size_t cap = 2 + 10 + (size_t)(end - arr) + 2 + 10 + 10 * (size_t)n + 1 + 10;
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    if (b == NULL) return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(b), *w = out;
    *w++ = 0x0a; /* out */
    put_varint(&w, (uint64_t)(end - arr));
    memcpy(w, arr, (size_t)(end - arr));
    w += end - arr;
    if (n) { /* lengths, packed int64 */
        uint8_t *vals = w + 12, *q = vals; /* (written past room for the tag and length) */
        for (Py_ssize_t i = 0; i < n; i++) {
            long long v = PyLong_AsLongLong(PyList_GET_ITEM(lengths, i));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(b);
                return NULL;
            }
            put_varint(&q, (uint64_t)v);
        }
        size_t len = (size_t)(q - vals);
        *w++ = 0x12;
        put_varint(&w, len);
        memmove(w, vals, len);
        w += len;
    }
    if (backend_ns) {
        *w++ = 0x18;
        put_varint(&w, backend_ns);
    }
    if (_PyBytes_Resize(&b, (Py_ssize_t)(w - out)) < 0) return NULL;
    return b;
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL,
     "setup(Experts, list cache size): what a list made from the per-triple cache is."},
    {"routed_args", (PyCFunction)(void (*)(void))routed_args, METH_FASTCALL,
     "routed_args(body, data, owner, cache, triple_cache, generation, max_experts, shm_view): "
     "(triples, device, x, routes, weights) of a routed expert group call this module reads, "
     "or None."},
    {"group_args", (PyCFunction)(void (*)(void))group_args, METH_FASTCALL,
     "group_args(body, data, owner, cache, triple_cache, generation, max_experts, shm_view): "
     "(triples, device, rows, x) of an expert group call this module reads, or None."},
    {"group_reply", (PyCFunction)(void (*)(void))group_reply, METH_FASTCALL,
     "group_reply(shape, nbytes, backend_ns, h2d_ns, kernel_ns, d2h_ns, shm, offset): a "
     "serialized ExpertGroupResponse whose y is float32 at a staged or shm slice."},
    {"ragged_args", (PyCFunction)(void (*)(void))ragged_args, METH_FASTCALL,
     "ragged_args(body, data, owner, cache, generation, max_sequences, shm_view, rows_in): "
     "(kv_b, proj_h, proj, q, rows, fresh, k, q_dim, rope_dim, v_dim, scale, o_proj) of a "
     "ragged attention call this module reads, or None."},
    {"ragged_reply", (PyCFunction)(void (*)(void))ragged_reply, METH_FASTCALL,
     "ragged_reply(shape, nbytes, lengths, backend_ns, shm, offset): a serialized "
     "AttentionRaggedResponse whose out is float32 at a staged or shm slice."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_fastpath", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    import_array();
    if ((s_routed = PyUnicode_InternFromString("expert_group_routed")) == NULL ||
        (s_group = PyUnicode_InternFromString("expert_group")) == NULL ||
        (s_ids = PyUnicode_InternFromString("ids")) == NULL ||
        (s_ragged = PyUnicode_InternFromString("attention_ragged")) == NULL ||
        (s_data = PyUnicode_InternFromString("data")) == NULL ||
        (s_spec = PyUnicode_InternFromString("spec")) == NULL ||
        (s_in_features = PyUnicode_InternFromString("in_features")) == NULL ||
        (s_out_features = PyUnicode_InternFromString("out_features")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
