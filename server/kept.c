/* The CuPy backend's kept decode calls, compiled: C twins of the Python that makes a kept
 * plan's call without a ``Call`` (server/kept.py builds and loads this module).
 *
 *   routed(pool, experts, x, routes, weights, stream, device, what)
 *       ``expert_group.routed_kept`` then ``cupy_calls.rerun``: a one-token routed group of K
 *       other experts whose plan the thread's top arena keeps (by its experts, or by the
 *       group's shape with the tables made for these experts), its graph launched and waited
 *       for; the call's ``Result``.
 *   group(pool, experts, rows, x, stream, device, what)
 *       ``expert_group.group_kept`` then ``cupy_calls.rerun``: an expert group below the
 *       pipelined size.
 *   matmul(pool, w, x, stream, device, what)
 *       ``matmul.run_kept`` then ``cupy_calls.rerun``: a matmul.
 *   ragged(pool, kv_b, o_proj, q, caches, fresh, t_max, q_dim, rope_dim, v_dim, scale,
 *          latents, ropes, n_sm, stream, device, what)
 *       ``attention_call.run_kept`` then ``cupy_calls.rerun``: a ragged attention call.
 *   rerun(a, rep, stream, device, what)
 *       ``cupy_calls.rerun``: a kept plan's graph launched on ``stream``, waited for (polling
 *       the D2H stamp with the GIL released, then the event), its output copied, the arena
 *       given back.
 *
 * Each returns None where its Python twin would find no such plan, or where an input is not
 * the plain float32 (or integer routes) array this file reads: nothing taken or written, the
 * caller makes the call through a ``Call``.
 *
 * The Python twins stay the reference and the definition of every rule: this module reads the
 * same objects (the arena's plans, the plan tuples and views, ``group_tables._triples``, the
 * ``TablePatch``) and calls back into Python for everything but the per-call glue (the
 * settings, ``rerunnable``, ``Arena.take`` / ``keep`` / ``give_back``, ``attention_call._key``,
 * a missed triple, the event's wait and phases, an error's mapping).
 * tests/kernels/test_arena_writes_cpu.py compares the bytes both write, call by call, and
 * test_kept_calls_cpu.py which calls each takes; both run the two ways. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* What setup() hands over: Python objects read on every call. */
static PyObject *eg_mod;        /* kernels.expert_group: ROUTE_ORDER */
static PyObject *cc_mod;        /* server.cupy_calls: POLL, POLL_NS */
static PyObject *settings_fn;   /* kernels.matmul.settings */
static PyObject *rerunnable_fn; /* cupy_calls.rerunnable */
static PyObject *triples_d;     /* group_tables._triples */
static PyObject *triples_of_fn; /* group_tables.triples_of */
static PyObject *zeros_t;       /* expert_group._ZEROS_T */
static PyObject *att_key_fn;    /* attention_call._key */
static PyObject *att_inputs_fn; /* attention_call._inputs (rows this file does not stack) */
static PyObject *result_t, *phases_t;
static PyObject *rt_mod; /* cupy.cuda.runtime: graphLaunch, eventSynchronize (read per call) */
static PyObject *event_phases_fn, *rerun_failed_fn;
static PyObject *s_group, *s_group_shape, *s_matmul, *k_routes, *k_xv;
static PyObject *one_int;
static PyObject *a_plans, *a_hmv, *a_take, *a_keep, *a_give_back, *a_sptr, *a_eptr;
static PyObject *r_exec, *r_stamped, *r_view, *r_ptr, *m_copy, *m_route_order, *m_poll,
    *m_poll_ns, *m_pipeline, *m_pipe_bytes, *m_graph_launch, *m_event_sync;
static PyObject *t_parts, *t_cs, *t_cuts, *t_nbytes, *s_out_features, *s_data, *s_latent,
    *s_rope, *s_length;

#define MAX_K 256

static int get(PyObject *ns, const char *name, PyObject **into) {
    PyObject *v = PyDict_GetItemString(ns, name); /* borrowed */
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "kept.setup: %s missing", name);
        return -1;
    }
    Py_XSETREF(*into, Py_NewRef(v));
    return 0;
}

static PyObject *setup(PyObject *self, PyObject *ns) {
    if (!PyDict_Check(ns)) {
        PyErr_SetString(PyExc_TypeError, "kept.setup: a dict");
        return NULL;
    }
    if (get(ns, "expert_group", &eg_mod) || get(ns, "cupy_calls", &cc_mod) ||
        get(ns, "settings", &settings_fn) || get(ns, "rerunnable", &rerunnable_fn) ||
        get(ns, "triples", &triples_d) || get(ns, "triples_of", &triples_of_fn) ||
        get(ns, "zeros_t", &zeros_t) || get(ns, "Result", &result_t) ||
        get(ns, "Phases", &phases_t) || get(ns, "runtime", &rt_mod) ||
        get(ns, "event_phases", &event_phases_fn) ||
        get(ns, "rerun_failed", &rerun_failed_fn) || get(ns, "attention_key", &att_key_fn) ||
        get(ns, "attention_inputs", &att_inputs_fn))
        return NULL;
    /* the KvDesc records written here are kernels/records.py's KV_DESC */
    PyObject *fmt = PyDict_GetItemString(ns, "kv_desc_format");
    if (fmt == NULL || !PyUnicode_Check(fmt) || PyUnicode_CompareWithASCIIString(fmt, "<QQii")) {
        PyErr_SetString(PyExc_ImportError, "kept.setup: KV_DESC is not <QQii (kept.c's KvDesc)");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Whether ``o`` is a C-contiguous array of one of the item formats ``fmts`` (of ``n`` items
 * where ``n`` >= 0): 1 with its buffer in ``b`` (to release), or 0 with no error set (the call
 * goes through a ``Call``). */
static int plain(PyObject *o, Py_buffer *b, const char *fmts, Py_ssize_t n, int writable) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                     (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (f[0] == '\0' || f[1] != '\0' || strchr(fmts, f[0]) == NULL ||
        (n >= 0 && b->len != n * b->itemsize)) {
        PyBuffer_Release(b);
        return 0;
    }
    return 1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ``cupy_calls.wait``: poll the arena's D2H stamp (``POLL``, for a stamped call) with the GIL
 * released, then, past ``POLL_NS`` or without polling, the event's wait. */
static int wait_call(PyObject *a, int stamped) {
    if (stamped) {
        PyObject *poll = PyObject_GetAttr(cc_mod, m_poll);
        if (poll == NULL) return -1;
        int on = PyObject_IsTrue(poll);
        Py_DECREF(poll);
        if (on < 0) return -1;
        if (on) {
            PyObject *p = PyObject_GetAttr(a, a_sptr), *pn = PyObject_GetAttr(cc_mod, m_poll_ns);
            if (p == NULL || pn == NULL) {
                Py_XDECREF(p);
                Py_XDECREF(pn);
                return -1;
            }
            volatile uint64_t *st = (volatile uint64_t *)PyLong_AsVoidPtr(p);
            long long limit = PyLong_AsLongLong(pn);
            Py_DECREF(p);
            Py_DECREF(pn);
            if (PyErr_Occurred()) return -1;
            if (st[3]) return 0;
            int done = 0;
            Py_BEGIN_ALLOW_THREADS;
            int64_t end = now_ns() + limit;
            for (;;) {
                sched_yield();
                if (st[3]) {
                    done = 1;
                    break;
                }
                if (now_ns() > end) break;
            }
            Py_END_ALLOW_THREADS;
            if (done) return 0;
        }
    }
    PyObject *ev = PyObject_GetAttr(a, a_eptr);
    if (ev == NULL) return -1;
    PyObject *e3 = PySequence_GetItem(ev, 3);
    Py_DECREF(ev);
    if (e3 == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg(rt_mod, m_event_sync, e3);
    Py_DECREF(e3);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* ``cupy_calls.rerun`` on a taken arena ``a`` whose inputs are written; ``lend``: the output
 * is the plan's view itself, not a copy (``rerun``'s ``lend``). */
static PyObject *rerun_taken(PyObject *a, PyObject *rep, PyObject *stream, PyObject *device,
                             PyObject *what, int lend) {
    PyObject *out = NULL, *phases = NULL, *res = NULL;
    int stamped = 0, failed = 1;
    PyObject *ex = PyObject_GetAttr(rep, r_exec);
    PyObject *ep = ex ? PyObject_GetAttr(ex, r_ptr) : NULL;
    PyObject *sp = ep ? PyObject_GetAttr(stream, r_ptr) : NULL;
    PyObject *st = sp ? PyObject_GetAttr(rep, r_stamped) : NULL;
    if (st != NULL && (stamped = PyObject_IsTrue(st)) >= 0) {
        PyObject *args[3] = {rt_mod, ep, sp};
        PyObject *r = PyObject_VectorcallMethod(m_graph_launch, args, 3, NULL);
        if (r != NULL) {
            Py_DECREF(r);
            failed = wait_call(a, stamped) < 0;
        }
    }
    Py_XDECREF(ex);
    Py_XDECREF(ep);
    Py_XDECREF(sp);
    Py_XDECREF(st);
    if (failed) { /* the GPU let finish, the error mapped (cupy_calls.rerun_failed) */
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc == NULL || !PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
            PyErr_Restore(type, exc, tb);
            return NULL;
        }
        if (tb != NULL) PyException_SetTraceback(exc, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        PyObject *args[4] = {exc, stream, device, what};
        PyObject *r = PyObject_Vectorcall(rerun_failed_fn, args, 4, NULL);
        Py_DECREF(exc);
        if (r != NULL) { /* it returns only where it has nothing to raise: a bug */
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "kept: rerun_failed returned");
        }
        return NULL;
    }
    PyObject *view = PyObject_GetAttr(rep, r_view);
    if (view == NULL) return NULL;
    out = lend ? Py_NewRef(view) : PyObject_CallMethodNoArgs(view, m_copy);
    Py_DECREF(view);
    if (out == NULL) return NULL;
    if (stamped) { /* _stamp_phases */
        PyObject *p = PyObject_GetAttr(a, a_sptr);
        if (p == NULL) goto done;
        const volatile uint64_t *s = (const volatile uint64_t *)PyLong_AsVoidPtr(p);
        Py_DECREF(p);
        if (PyErr_Occurred()) goto done;
        uint64_t h0 = s[0], h1 = s[1], d0 = s[2], d1 = s[3];
        int64_t k = (int64_t)(d0 - h1);
        phases = PyObject_CallFunction(phases_t, "LLL", (long long)(int64_t)(h1 - h0),
                                       (long long)(k > 0 ? k : 0),
                                       (long long)(int64_t)(d1 - d0));
    } else {
        phases = PyObject_CallOneArg(event_phases_fn, a);
    }
    if (phases == NULL) goto done;
    PyObject *g = PyObject_CallMethodNoArgs(a, a_give_back);
    if (g == NULL) goto done;
    Py_DECREF(g);
    PyObject *args[2] = {out, phases};
    res = PyObject_Vectorcall(result_t, args, 2, NULL);
done:
    Py_DECREF(out);
    Py_XDECREF(phases);
    return res;
}

/* The optional last argument ``lend`` of an entry taking ``n`` arguments before it: 0 or 1,
 * -1 with an error set. */
static int lend_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n) {
    return nargs > n ? PyObject_IsTrue(args[n]) : 0;
}

static PyObject *rerun(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 5 && n != 6) {
        PyErr_SetString(PyExc_TypeError, "kept.rerun(a, rep, stream, device, what[, lend])");
        return NULL;
    }
    int lend = lend_arg(args, n, 5);
    if (lend < 0) return NULL;
    return rerun_taken(args[0], args[1], args[2], args[3], args[4], lend);
}

/* ``Arena.keep``: ``plan`` from here on the plan whose constant bytes (``n`` at ``src``) the
 * arena holds at ``dst``, written there unless they are already (``last`` is ``plan``). */
static int keep_bytes(PyObject *a, PyObject *last, PyObject *plan, char *dst, const char *src,
                      Py_ssize_t n) {
    PyObject *args[3] = {a, last, plan};
    PyObject *kept = PyObject_VectorcallMethod(a_keep, args, 3, NULL);
    if (kept == NULL) return -1;
    int same = PyObject_IsTrue(kept);
    Py_DECREF(kept);
    if (same < 0) return -1;
    if (!same) memcpy(dst, src, n);
    return 0;
}

/* The tables of a group-shape plan for these experts, written at ``dst`` (``TablePatch.fill``:
 * the shape's constant runs and the experts' packed addresses, or a range of them). */
static int fill_tables(PyObject *where, PyObject *triples, char *dst, Py_ssize_t room) {
    PyObject *parts = PyObject_GetAttr(where, t_parts), *cs = PyObject_GetAttr(where, t_cs),
             *cuts = PyObject_GetAttr(where, t_cuts), *nb = PyObject_GetAttr(where, t_nbytes);
    int rc = -1;
    if (parts == NULL || cs == NULL || cuts == NULL || nb == NULL) goto out;
    Py_ssize_t nbytes = PyLong_AsSsize_t(nb);
    if (nbytes == -1 && PyErr_Occurred()) goto out;
    if (nbytes > room) goto short_room;
    room = nbytes; /* the slice fill() is written to: as long as its result must be */
    if (!PyList_Check(parts) || !PyList_Check(cs) || !PyList_Check(cuts) ||
        PyList_GET_SIZE(parts) != 2 * PyList_GET_SIZE(cs) + 1 ||
        PyList_GET_SIZE(cuts) != PyList_GET_SIZE(cs)) {
        PyErr_SetString(PyExc_TypeError, "kept: a TablePatch of another layout");
        goto out;
    }
    Py_ssize_t at = 0, nslots = PyList_GET_SIZE(cs);
    for (Py_ssize_t i = 0; i <= nslots; i++) {
        PyObject *run = PyList_GET_ITEM(parts, 2 * i);
        if (!PyBytes_Check(run)) {
            PyErr_SetString(PyExc_TypeError, "kept: a TablePatch part is not bytes");
            goto out;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(run);
        if (at + len > room) goto short_room;
        memcpy(dst + at, PyBytes_AS_STRING(run), len);
        at += len;
        if (i == nslots) break;
        Py_ssize_t c = PyLong_AsSsize_t(PyList_GET_ITEM(cs, i));
        if (c == -1 && PyErr_Occurred()) goto out;
        PyObject *e = PySequence_GetItem(triples, c); /* IndexError as fill's */
        if (e == NULL) goto out;
        PyObject *addrs = PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 3 ? PyTuple_GET_ITEM(e, 2)
                                                                       : NULL;
        if (addrs == NULL || !PyBytes_Check(addrs)) {
            Py_DECREF(e);
            PyErr_SetString(PyExc_TypeError, "kept: a triples_of entry of another layout");
            goto out;
        }
        Py_ssize_t lo = 0, hi = PyBytes_GET_SIZE(addrs);
        PyObject *cut = PyList_GET_ITEM(cuts, i);
        if (cut != Py_None) {
            if (!PyArg_ParseTuple(cut, "nn", &lo, &hi)) {
                Py_DECREF(e);
                goto out;
            }
            if (lo < 0) lo = 0;
            if (hi > PyBytes_GET_SIZE(addrs)) hi = PyBytes_GET_SIZE(addrs);
            if (hi < lo) hi = lo;
        }
        if (at + (hi - lo) > room) {
            Py_DECREF(e);
            goto short_room;
        }
        memcpy(dst + at, PyBytes_AS_STRING(addrs) + lo, hi - lo);
        at += hi - lo;
        Py_DECREF(e);
    }
    if (at != nbytes) goto short_room;
    rc = 0;
    goto out;
short_room:
    PyErr_SetString(PyExc_ValueError,
                    "kept: a group's tables are not the length its TablePatch keeps room for");
out:
    Py_XDECREF(nb);
    Py_XDECREF(parts);
    Py_XDECREF(cs);
    Py_XDECREF(cuts);
    return rc;
}

/* A list or a tuple, read in place. */
#define SEQ_CHECK(o) (PyList_Check(o) || PyTuple_Check(o))
#define SEQ_SIZE(o) (PyList_Check(o) ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o))
#define SEQ_ITEM(o, i) (PyList_Check(o) ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i))

/* ``_kept_plan``'s key: (kind, settings, *ids or the shape, *rows, T, D, extra_in, extra_out,
 * xr), ``kind`` "group" with the experts' ids or "group shape" with the shape's tuple;
 * ``rows`` a list or tuple of K, or NULL: K ones (a one-token group's). */
static PyObject *plan_key(PyObject *kind, PyObject *settings, PyObject **ids, Py_ssize_t n_ids,
                          Py_ssize_t K, PyObject *rows, PyObject *T, PyObject *D,
                          PyObject *extra_in, PyObject *extra_out, PyObject *xr) {
    PyObject *key = PyTuple_New(2 + n_ids + K + 5);
    if (key == NULL) return NULL;
    Py_ssize_t i = 0;
    PyTuple_SET_ITEM(key, i++, Py_NewRef(kind));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(settings));
    for (Py_ssize_t j = 0; j < n_ids; j++) PyTuple_SET_ITEM(key, i++, Py_NewRef(ids[j]));
    for (Py_ssize_t j = 0; j < K; j++)
        PyTuple_SET_ITEM(key, i++, Py_NewRef(rows ? SEQ_ITEM(rows, j) : one_int));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(T));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(D));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(extra_in));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(extra_out));
    PyTuple_SET_ITEM(key, i++, Py_NewRef(xr));
    return key;
}

/* ``triples_of``'s entries of ``sel`` (kept ones looked up here; where one is missing, the
 * Python function makes them), as a new list. */
static PyObject *triples_of(PyObject **sel, PyObject **ids, Py_ssize_t K) {
    PyObject *out = PyList_New(K);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < K; j++) {
        PyObject *t = PyDict_GetItemWithError(triples_d, ids[j]);
        if (t == NULL) {
            Py_DECREF(out);
            if (PyErr_Occurred()) return NULL;
            PyObject *seq = PyList_New(K);
            if (seq == NULL) return NULL;
            for (Py_ssize_t i = 0; i < K; i++) PyList_SET_ITEM(seq, i, Py_NewRef(sel[i]));
            out = PyObject_CallOneArg(triples_of_fn, seq);
            Py_DECREF(seq);
            return out;
        }
        PyList_SET_ITEM(out, j, Py_NewRef(t));
    }
    return out;
}

/* A writable view's buffer of exactly ``nbytes`` bytes of one of ``fmts`` (0: not one). */
static int span(PyObject *o, Py_buffer *b, const char *fmts, Py_ssize_t nbytes) {
    if (!plain(o, b, fmts, -1, 1)) return 0;
    if (b->len != nbytes) {
        PyBuffer_Release(b);
        return 0;
    }
    return 1;
}

/* ``_kept_plan``: the plan arena ``a`` keeps for the group of ``sel`` (ids ``ids``), by the
 * experts themselves, else by the group's shape (``*triples`` then set: the experts'
 * ``triples_of`` entries). A new reference, or NULL: none (no error set) or an error. */
static PyObject *find_plan(PyObject *a, PyObject **sel, PyObject **ids, Py_ssize_t K,
                           PyObject *rows, PyObject *T, PyObject *D, PyObject *extra_in,
                           PyObject *extra_out, PyObject *xr, PyObject **triples) {
    PyObject *settings = NULL, *plans = NULL, *key = NULL, *shape = NULL, *hit = NULL;
    if ((settings = PyObject_CallNoArgs(settings_fn)) == NULL) goto out;
    if ((plans = PyObject_GetAttr(a, a_plans)) == NULL) goto out;
    if (!PyDict_Check(plans)) goto out;
    key = plan_key(s_group, settings, ids, K, K, rows, T, D, extra_in, extra_out, xr);
    if (key == NULL) goto out;
    hit = Py_XNewRef(PyDict_GetItemWithError(plans, key));
    if (hit != NULL || PyErr_Occurred()) goto out;
    if ((*triples = triples_of(sel, ids, K)) == NULL) goto out;
    if (!PyList_Check(*triples) || PyList_GET_SIZE(*triples) != K) goto out;
    if ((shape = PyTuple_New(K)) == NULL) goto out;
    for (Py_ssize_t j = 0; j < K; j++) {
        PyObject *t = PyList_GET_ITEM(*triples, j);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) goto out;
        PyTuple_SET_ITEM(shape, j, Py_NewRef(PyTuple_GET_ITEM(t, 1)));
    }
    Py_SETREF(key, plan_key(s_group_shape, settings, &shape, 1, K, rows, T, D, extra_in,
                            extra_out, xr));
    if (key != NULL) hit = Py_XNewRef(PyDict_GetItemWithError(plans, key));
out:
    Py_XDECREF(settings);
    Py_XDECREF(plans);
    Py_XDECREF(key);
    Py_XDECREF(shape);
    return hit;
}

/* ``_kept_tables``: a kept plan's tables in the arena's host half (``hb``), ``last`` being
 * the plan whose constant bytes it held when the call took it. */
static int write_tables(PyObject *a, PyObject *last, PyObject *hit, PyObject *triples,
                        Py_buffer *hb) {
    Py_ssize_t t_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(hit, 3));
    PyObject *table = PyTuple_GET_ITEM(hit, 4), *where = PyTuple_GET_ITEM(hit, 5);
    if (t_off == -1 && PyErr_Occurred()) return -1;
    if (t_off < 0 || t_off > hb->len) {
        PyErr_SetString(PyExc_ValueError, "kept: a plan's tables past its arena");
        return -1;
    }
    if (where == Py_None) { /* the plan's own: in place unless another plan's bytes lie */
        if (!PyBytes_Check(table) || PyBytes_GET_SIZE(table) > hb->len - t_off) {
            PyErr_SetString(PyExc_ValueError, "kept: a plan's tables past its arena");
            return -1;
        }
        return keep_bytes(a, last, hit, (char *)hb->buf + t_off, PyBytes_AS_STRING(table),
                          PyBytes_GET_SIZE(table));
    }
    if (triples == NULL) { /* (a plan kept by its experts holds its tables made) */
        PyErr_SetString(PyExc_TypeError, "kept: an experts' plan with a shape's tables");
        return -1;
    }
    return fill_tables(where, triples, (char *)hb->buf + t_off, hb->len - t_off);
}

/* Whether ``rep`` may be rerun (``cupy_calls.rerunnable``): 1, 0, or -1 (an error). */
static int ready(PyObject *rep) {
    PyObject *r = PyObject_CallOneArg(rerunnable_fn, rep);
    if (r == NULL) return -1;
    int ok = PyObject_IsTrue(r);
    Py_DECREF(r);
    return ok;
}

/* experts[e] for each of ``K`` indices (the IndexError itemgetter raises), with their ids;
 * the number got (== K, or fewer with an error set). */
static Py_ssize_t select_experts(PyObject *experts, const long long *e, PyObject **sel,
                                 PyObject **ids, Py_ssize_t K, PyObject *seq) {
    Py_ssize_t got = 0;
    for (; got < K; got++) {
        if (seq != NULL) {
            sel[got] = Py_NewRef(SEQ_ITEM(seq, got));
        } else {
            PyObject *idx = PyLong_FromLongLong(e[got]);
            if (idx == NULL) break;
            sel[got] = PyObject_GetItem(experts, idx);
            Py_DECREF(idx);
            if (sel[got] == NULL) break;
        }
        ids[got] = PyLong_FromVoidPtr(sel[got]);
        if (ids[got] == NULL) {
            Py_DECREF(sel[got]);
            break;
        }
    }
    return got;
}

/* One kept group call (``routed`` or ``group``): its experts, arena, plan and buffers. */
struct group_call {
    Py_ssize_t K, got;
    PyObject *a, *hit, *triples, *last, *hmv; /* hit: the plan tuple */
    PyObject *off, *rep;                      /* borrowed from hit: its offsets, its Replay */
    Py_buffer xb, xv, hb;                     /* x, where x goes, the arena's host half */
    int have_x, have_xv, have_h;
    PyObject *sel[MAX_K], *ids[MAX_K]; /* the experts in slot order, their ids (got of K) */
};

/* Everything but the experts' slots cleared (those are set as they are got). */
#define GROUP_CALL(g)                                                                       \
    struct group_call g;                                                                    \
    memset(&g, 0, offsetof(struct group_call, sel))

static void group_release(struct group_call *g) {
    for (Py_ssize_t j = 0; j < g->got; j++) {
        Py_DECREF(g->sel[j]);
        Py_DECREF(g->ids[j]);
    }
    if (g->have_x) PyBuffer_Release(&g->xb);
    if (g->have_xv) PyBuffer_Release(&g->xv);
    if (g->have_h) PyBuffer_Release(&g->hb);
    Py_XDECREF(g->a);
    Py_XDECREF(g->hit);
    Py_XDECREF(g->triples);
    Py_XDECREF(g->last);
    Py_XDECREF(g->hmv);
}

/* The plan the top arena of ``pool`` keeps for the group (``_kept_plan`` with these keys),
 * rerunnable, and where its x and tables go: 1, 0 (no such plan: nothing taken) or -1. */
static int group_plan(struct group_call *g, PyObject *pool, PyObject *rows, PyObject *T,
                      PyObject *D, PyObject *extra_in, PyObject *extra_out, PyObject *xr) {
    g->a = Py_NewRef(PyList_GET_ITEM(pool, PyList_GET_SIZE(pool) - 1));
    g->hit = find_plan(g->a, g->sel, g->ids, g->K, rows, T, D, extra_in, extra_out, xr,
                       &g->triples);
    if (g->hit == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(g->hit) || PyTuple_GET_SIZE(g->hit) < 9) return 0;
    g->off = PyTuple_GET_ITEM(g->hit, 7);
    g->rep = PyTuple_GET_ITEM(g->hit, 8);
    if (g->rep == Py_None || !PyDict_Check(g->off)) return 0;
    int r = ready(g->rep);
    if (r <= 0) return r;
    PyObject *xview = PyDict_GetItemWithError(g->off, k_xv);
    if (xview == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!(g->have_xv = span(xview, &g->xv, "f", g->xb.len))) return 0;
    if ((g->hmv = PyObject_GetAttr(g->a, a_hmv)) == NULL) return -1;
    if (PyObject_GetBuffer(g->hmv, &g->hb, PyBUF_WRITABLE) < 0) return -1;
    g->have_h = 1;
    return 1;
}

/* The arena taken (``Arena.take``), x and the tables written (``_kept_tables``). */
static int group_take(struct group_call *g) {
    if ((g->last = PyObject_CallMethodNoArgs(g->a, a_take)) == NULL) return -1;
    memcpy(g->xv.buf, g->xb.buf, g->xb.len);
    return write_tables(g->a, g->last, g->hit, g->triples, &g->hb);
}

static PyObject *routed(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "kept.routed(pool, experts, x, routes, weights, stream, device, what)");
        return NULL;
    }
    PyObject *pool = args[0], *experts = args[1], *x = args[2], *routes = args[3],
             *weights = args[4];
    GROUP_CALL(g);
    PyObject *res = NULL, *D = NULL, *extra_in = NULL, *extra_out = NULL, *views = NULL;
    Py_buffer rb, wb, pv, wv;
    int have_r = 0, have_w = 0, have_pv = 0, have_wv = 0, r;
    long long e[MAX_K];

    /* _one_token: ROUTE_ORDER on, one token, K other experts; the inputs plain arrays */
    PyObject *order = PyObject_GetAttr(eg_mod, m_route_order);
    if (order == NULL) return NULL;
    int on = PyObject_IsTrue(order);
    Py_DECREF(order);
    if (on <= 0) return on < 0 ? NULL : Py_NewRef(Py_None);
    if (!(have_r = plain(routes, &rb, "ilq", -1, 0)) || rb.ndim != 2 || rb.shape[0] != 1 ||
        (rb.itemsize != 4 && rb.itemsize != 8))
        goto none;
    Py_ssize_t K = g.K = rb.shape[1];
    if (K < 1 || K > MAX_K) goto none;
    if (!(g.have_x = plain(x, &g.xb, "f", -1, 0)) || g.xb.ndim != 2 || g.xb.shape[0] != 1)
        goto none;
    if (!(have_w = plain(weights, &wb, "f", K, 0)) || wb.ndim != 2 || wb.shape[0] != 1)
        goto none;
    for (Py_ssize_t j = 0; j < K; j++) {
        e[j] = rb.itemsize == 4 ? ((int32_t *)rb.buf)[j] : ((int64_t *)rb.buf)[j];
        for (Py_ssize_t i = 0; i < j; i++)
            if (e[i] == e[j]) goto none; /* a repeated expert: route_plan's way */
    }
    if (!PyList_Check(pool) || PyList_GET_SIZE(pool) == 0) goto none;
    if ((g.got = select_experts(experts, e, g.sel, g.ids, K, NULL)) < K) goto fail;

    /* _kept_plan(a, sel, _ONES[K], 1, D, 2 * align(4K), 4 * experts[0][2].out_features,
     * _ZEROS_T[K]) */
    {
        PyObject *e0 = PySequence_GetItem(experts, 0), *down = NULL, *dout = NULL;
        if (e0 != NULL) down = PySequence_GetItem(e0, 2);
        if (down != NULL) dout = PyObject_GetAttr(down, s_out_features);
        Py_XDECREF(e0);
        Py_XDECREF(down);
        if (dout == NULL) goto fail;
        long long d = PyLong_AsLongLong(dout);
        Py_DECREF(dout);
        if (d == -1 && PyErr_Occurred()) goto fail;
        extra_out = PyLong_FromLongLong(4 * d);
    }
    D = PyLong_FromSsize_t(g.xb.shape[1]);
    extra_in = PyLong_FromSsize_t(2 * ((4 * K + 255) / 256 * 256));
    if (extra_out == NULL || D == NULL || extra_in == NULL) goto fail;
    PyObject *xr; /* borrowed */
    {
        PyObject *k = PyLong_FromSsize_t(K);
        if (k == NULL) goto fail;
        xr = PyDict_GetItemWithError(zeros_t, k);
        Py_DECREF(k);
        if (xr == NULL) {
            if (!PyErr_Occurred()) goto none;
            goto fail;
        }
    }
    if ((r = group_plan(&g, pool, NULL, one_int, D, extra_in, extra_out, xr)) <= 0) {
        if (r < 0) goto fail;
        goto none;
    }
    /* pos and w: the plan's views */
    views = Py_XNewRef(PyDict_GetItemWithError(g.off, k_routes));
    if (views == NULL) {
        if (PyErr_Occurred()) goto fail;
        goto none;
    }
    if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) < 2 ||
        !(have_pv = span(PyTuple_GET_ITEM(views, 0), &pv, "i", 4 * K)) ||
        !(have_wv = span(PyTuple_GET_ITEM(views, 1), &wv, "f", 4 * K)))
        goto none;

    /* the call: the arena taken, its inputs written as routed_kept writes them */
    if (group_take(&g) < 0) goto fail;
    for (Py_ssize_t j = 0; j < K; j++) ((int32_t *)pv.buf)[j] = (int32_t)j;
    memcpy(wv.buf, wb.buf, 4 * K);
    res = rerun_taken(g.a, g.rep, args[5], args[6], args[7], 0);
    goto out;
none:
    res = Py_NewRef(Py_None);
    goto out;
fail:
    res = NULL;
out:
    group_release(&g);
    if (have_r) PyBuffer_Release(&rb);
    if (have_w) PyBuffer_Release(&wb);
    if (have_pv) PyBuffer_Release(&pv);
    if (have_wv) PyBuffer_Release(&wv);
    Py_XDECREF(D);
    Py_XDECREF(extra_in);
    Py_XDECREF(extra_out);
    Py_XDECREF(views);
    return res;
}

/* ``expert_group.group_kept`` then ``cupy_calls.rerun``. */
static PyObject *group(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 7 && n != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "kept.group(pool, experts, rows, x, stream, device, what[, lend])");
        return NULL;
    }
    int lend = lend_arg(args, n, 7);
    if (lend < 0) return NULL;
    PyObject *pool = args[0], *experts = args[1], *rows = args[2], *x = args[3];
    GROUP_CALL(g);
    PyObject *res = NULL, *T = NULL, *D = NULL, *zero = NULL;
    int r;
    if (!PyList_Check(pool) || PyList_GET_SIZE(pool) == 0 || !SEQ_CHECK(experts) ||
        !SEQ_CHECK(rows) || (g.K = SEQ_SIZE(experts)) < 1 || g.K > MAX_K ||
        SEQ_SIZE(rows) != g.K)
        return Py_NewRef(Py_None);
    if (!(g.have_x = plain(x, &g.xb, "f", -1, 0)) || g.xb.ndim != 2) goto none;
    { /* PIPELINE and 4 * x.size >= PIPE_BYTES: the pipelined call's */
        PyObject *pipe = PyObject_GetAttr(eg_mod, m_pipeline), *pb = NULL;
        if (pipe == NULL) goto fail;
        int on = PyObject_IsTrue(pipe);
        Py_DECREF(pipe);
        if (on < 0) goto fail;
        if (on) {
            if ((pb = PyObject_GetAttr(eg_mod, m_pipe_bytes)) == NULL) goto fail;
            long long lim = PyLong_AsLongLong(pb);
            Py_DECREF(pb);
            if (lim == -1 && PyErr_Occurred()) goto fail;
            if ((long long)g.xb.len >= lim) goto none;
        }
    }
    if ((g.got = select_experts(experts, NULL, g.sel, g.ids, g.K, experts)) < g.K) goto fail;
    T = PyLong_FromSsize_t(g.xb.shape[0]);
    D = PyLong_FromSsize_t(g.xb.shape[1]);
    zero = PyLong_FromLong(0);
    if (T == NULL || D == NULL || zero == NULL) goto fail;
    if ((r = group_plan(&g, pool, rows, T, D, zero, zero, Py_None)) <= 0) {
        if (r < 0) goto fail;
        goto none;
    }
    if (group_take(&g) < 0) goto fail;
    res = rerun_taken(g.a, g.rep, args[4], args[5], args[6], lend);
    goto out;
none:
    res = Py_NewRef(Py_None);
    goto out;
fail:
    res = NULL;
out:
    group_release(&g);
    Py_XDECREF(T);
    Py_XDECREF(D);
    Py_XDECREF(zero);
    return res;
}

/* ``matmul.run_kept`` then ``cupy_calls.rerun``. */
static PyObject *matmul(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "kept.matmul(pool, w, x, stream, device, what)");
        return NULL;
    }
    PyObject *pool = args[0], *w = args[1], *x = args[2];
    PyObject *res = NULL, *a = NULL, *plans = NULL, *key = NULL, *plan = NULL, *last = NULL;
    Py_buffer xb, xv, jv, jb;
    int have_x = 0, have_xv = 0, have_jv = 0, have_jb = 0, r;
    if (!PyList_Check(pool) || PyList_GET_SIZE(pool) == 0) return Py_NewRef(Py_None);
    if (!(have_x = plain(x, &xb, "f", -1, 0)) || xb.ndim != 2) goto none;
    a = Py_NewRef(PyList_GET_ITEM(pool, PyList_GET_SIZE(pool) - 1));
    /* the plan kept by ("matmul", id(w), rows, settings()) */
    if ((key = PyTuple_New(4)) == NULL) goto fail;
    PyTuple_SET_ITEM(key, 0, Py_NewRef(s_matmul));
    PyObject *v;
    if ((v = PyLong_FromVoidPtr(w)) == NULL) goto fail;
    PyTuple_SET_ITEM(key, 1, v);
    if ((v = PyLong_FromSsize_t(xb.shape[0])) == NULL) goto fail;
    PyTuple_SET_ITEM(key, 2, v);
    if ((v = PyObject_CallNoArgs(settings_fn)) == NULL) goto fail;
    PyTuple_SET_ITEM(key, 3, v);
    if ((plans = PyObject_GetAttr(a, a_plans)) == NULL) goto fail;
    if (!PyDict_Check(plans)) goto none;
    plan = Py_XNewRef(PyDict_GetItemWithError(plans, key));
    if (plan == NULL) {
        if (PyErr_Occurred()) goto fail;
        goto none;
    }
    /* (w, launch, job bytes, Replay, (x's view, the job's view)) */
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 5) goto none;
    PyObject *job = PyTuple_GET_ITEM(plan, 2), *rep = PyTuple_GET_ITEM(plan, 3),
             *views = PyTuple_GET_ITEM(plan, 4);
    if ((r = ready(rep)) <= 0) {
        if (r < 0) goto fail;
        goto none;
    }
    if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) != 2 ||
        !(have_xv = span(PyTuple_GET_ITEM(views, 0), &xv, "f", xb.len)) ||
        !(have_jb = plain(job, &jb, "B", -1, 0)) ||
        !(have_jv = span(PyTuple_GET_ITEM(views, 1), &jv, "B", jb.len)))
        goto none;

    if ((last = PyObject_CallMethodNoArgs(a, a_take)) == NULL) goto fail;
    memcpy(xv.buf, xb.buf, xb.len);
    if (keep_bytes(a, last, plan, jv.buf, jb.buf, jb.len) < 0) goto fail;
    res = rerun_taken(a, rep, args[3], args[4], args[5], 0);
    goto out;
none:
    res = Py_NewRef(Py_None);
    goto out;
fail:
    res = NULL;
out:
    if (have_x) PyBuffer_Release(&xb);
    if (have_xv) PyBuffer_Release(&xv);
    if (have_jv) PyBuffer_Release(&jv);
    if (have_jb) PyBuffer_Release(&jb);
    Py_XDECREF(a);
    Py_XDECREF(plans);
    Py_XDECREF(key);
    Py_XDECREF(plan);
    Py_XDECREF(last);
    return res;
}

/* A KvDesc (kernels/records.py's KV_DESC, checked in setup). */
struct KvDesc {
    uint64_t latent, rope;
    int32_t len, src;
};

/* The device address of a cache's ``which`` (``c.latent.data.ptr``); 0 with an error set
 * where it cannot be read. */
static uint64_t cache_ptr(PyObject *c, PyObject *which, int *err) {
    PyObject *arr = PyObject_GetAttr(c, which), *data = NULL, *ptr = NULL;
    uint64_t v = 0;
    if (arr != NULL) data = PyObject_GetAttr(arr, s_data);
    if (data != NULL) ptr = PyObject_GetAttr(data, r_ptr);
    if (ptr != NULL) v = PyLong_AsUnsignedLongLong(ptr);
    if (ptr == NULL || PyErr_Occurred()) *err = 1;
    Py_XDECREF(arr);
    Py_XDECREF(data);
    Py_XDECREF(ptr);
    return v;
}

/* Whether ``parts`` can be stacked into ``view`` here (``stack``, as ``pinned.stack_into``
 * does): float32 row blocks [n_i, w], contiguous, of the view's width, filling it exactly. */
static int stackable(PyObject *parts, const Py_buffer *view) {
    if (!SEQ_CHECK(parts) || view->ndim != 2) return 0;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < SEQ_SIZE(parts); i++) {
        Py_buffer b;
        if (!plain(SEQ_ITEM(parts, i), &b, "f", -1, 0)) return 0;
        int ok = b.ndim == 2 && b.shape[1] == view->shape[1];
        total += b.len;
        PyBuffer_Release(&b);
        if (!ok) return 0;
    }
    return total == view->len;
}

static void stack(PyObject *parts, char *dst) {
    for (Py_ssize_t i = 0; i < SEQ_SIZE(parts); i++) {
        Py_buffer b;
        if (plain(SEQ_ITEM(parts, i), &b, "f", -1, 0)) { /* (stackable checked) */
            memcpy(dst, b.buf, b.len);
            dst += b.len;
            PyBuffer_Release(&b);
        }
    }
}

/* ``attention_call._inputs`` for a ragged call (caches given): the new rows, the KvDescs,
 * the gemv jobs unless the arena holds them (``Arena.keep``). */
static int ragged_inputs(PyObject *a, PyObject *last, PyObject *plan, char *host,
                         Py_ssize_t hlen, PyObject *caches, PyObject *fresh, PyObject *latents,
                         PyObject *ropes, Py_ssize_t n_up, Py_buffer *lv, Py_buffer *rv) {
    Py_ssize_t d_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, 3));
    Py_ssize_t j_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, 4));
    if (PyErr_Occurred()) return -1;
    if (n_up) {
        stack(latents, lv->buf);
        stack(ropes, rv->buf);
    }
    Py_ssize_t n = SEQ_SIZE(caches);
    if (d_off < 0 || d_off + n * (Py_ssize_t)sizeof(struct KvDesc) > hlen) {
        PyErr_SetString(PyExc_ValueError, "kept: a call's KvDescs past its arena");
        return -1;
    }
    int32_t src = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = SEQ_ITEM(caches, i);
        long long fr = PyLong_AsLongLong(SEQ_ITEM(fresh, i));
        if (fr == -1 && PyErr_Occurred()) return -1;
        struct KvDesc d = {0, 0, 0, src};
        PyObject *lat = PyObject_GetAttr(c, s_latent);
        if (lat == NULL) return -1;
        int none = lat == Py_None, err = 0;
        Py_DECREF(lat);
        if (!none) {
            PyObject *len = PyObject_GetAttr(c, s_length);
            if (len == NULL) return -1;
            long long l = PyLong_AsLongLong(len);
            Py_DECREF(len);
            if (l == -1 && PyErr_Occurred()) return -1;
            d.latent = cache_ptr(c, s_latent, &err);
            d.rope = cache_ptr(c, s_rope, &err);
            if (err) return -1;
            d.len = (int32_t)(l + fr);
        }
        memcpy(host + d_off + i * sizeof d, &d, sizeof d);
        src += (int32_t)fr;
    }
    PyObject *jobs = PyTuple_GET_ITEM(plan, 11);
    if (!PyBytes_Check(jobs) || j_off < 0 || j_off + PyBytes_GET_SIZE(jobs) > hlen) {
        PyErr_SetString(PyExc_ValueError, "kept: a call's gemv jobs past its arena");
        return -1;
    }
    return keep_bytes(a, last, plan, host + j_off, PyBytes_AS_STRING(jobs),
                      PyBytes_GET_SIZE(jobs));
}

/* ``attention_call.run_kept`` then ``cupy_calls.rerun``. */
static PyObject *ragged(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 17) {
        PyErr_SetString(PyExc_TypeError,
                        "kept.ragged(pool, kv_b, o_proj, q, caches, fresh, t_max, q_dim, "
                        "rope_dim, v_dim, scale, latents, ropes, n_sm, stream, device, what)");
        return NULL;
    }
    PyObject *pool = args[0], *q = args[3], *caches = args[4], *fresh = args[5],
             *latents = args[11], *ropes = args[12];
    PyObject *res = NULL, *got = NULL, *a = NULL, *plans = NULL, *plan = NULL, *last = NULL,
             *hmv = NULL;
    Py_buffer qb, qv, lv, rv, hb;
    int have_q = 0, have_qv = 0, have_lv = 0, have_rv = 0, have_h = 0;
    if (!PyList_Check(pool) || PyList_GET_SIZE(pool) == 0 || !SEQ_CHECK(caches) ||
        !SEQ_CHECK(fresh) || SEQ_SIZE(caches) != SEQ_SIZE(fresh))
        return Py_NewRef(Py_None);
    /* _key(kv_b, o_proj, q, False, t_max, q_dim, rope_dim, v_dim, scale, latents, n_sm) */
    PyObject *kargs[11] = {args[1], args[2], q, Py_False, args[6], args[7], args[8], args[9],
                           args[10], latents, args[13]};
    got = PyObject_Vectorcall(att_key_fn, kargs, 11, NULL);
    if (got == NULL) return NULL;
    if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 4) goto none;
    Py_ssize_t n_up = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 2));
    if (n_up == -1 && PyErr_Occurred()) goto fail;
    a = Py_NewRef(PyList_GET_ITEM(pool, PyList_GET_SIZE(pool) - 1));
    if ((plans = PyObject_GetAttr(a, a_plans)) == NULL) goto fail;
    if (!PyDict_Check(plans)) goto none;
    plan = Py_XNewRef(PyDict_GetItemWithError(plans, PyTuple_GET_ITEM(got, 0)));
    if (plan == NULL) {
        if (PyErr_Occurred()) goto fail;
        goto none;
    }
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 15) goto none;
    PyObject *rep = PyTuple_GET_ITEM(plan, 13), *views = PyTuple_GET_ITEM(plan, 14);
    int r = ready(rep);
    if (r <= 0) {
        if (r < 0) goto fail;
        goto none;
    }
    /* what the call writes, checked before the arena is taken: q and the new rows plain
     * float32 filling their views (else the Python writes them, with its conversions) */
    if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) < 4) goto none;
    if (!(have_q = plain(q, &qb, "f", -1, 0)) ||
        !(have_qv = span(PyTuple_GET_ITEM(views, 0), &qv, "f", qb.len)))
        goto none;
    int fast = 1;
    if (n_up) {
        fast = (have_lv = plain(PyTuple_GET_ITEM(views, 2), &lv, "f", -1, 1)) &&
               (have_rv = plain(PyTuple_GET_ITEM(views, 3), &rv, "f", -1, 1)) &&
               stackable(latents, &lv) && stackable(ropes, &rv);
    }
    if ((hmv = PyObject_GetAttr(a, a_hmv)) == NULL) goto fail;
    if (PyObject_GetBuffer(hmv, &hb, PyBUF_WRITABLE) < 0) goto fail;
    have_h = 1;

    if ((last = PyObject_CallMethodNoArgs(a, a_take)) == NULL) goto fail;
    memcpy(qv.buf, qb.buf, qb.len);
    if (fast) {
        if (ragged_inputs(a, last, plan, hb.buf, hb.len, caches, fresh, latents, ropes, n_up,
                          &lv, &rv) < 0)
            goto fail;
    } else { /* _inputs(a, last, plan, S, caches, fresh, latents, ropes, n_up) */
        PyObject *S = PyLong_FromSsize_t(qb.ndim ? qb.shape[0] : 1);
        if (S == NULL) goto fail;
        PyObject *iargs[9] = {a, last, plan, S, caches, fresh, latents, ropes,
                              PyTuple_GET_ITEM(got, 2)};
        PyObject *r = PyObject_Vectorcall(att_inputs_fn, iargs, 9, NULL);
        Py_DECREF(S);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    res = rerun_taken(a, rep, args[14], args[15], args[16], 0);
    goto out;
none:
    res = Py_NewRef(Py_None);
    goto out;
fail:
    res = NULL;
out:
    if (have_q) PyBuffer_Release(&qb);
    if (have_qv) PyBuffer_Release(&qv);
    if (have_lv) PyBuffer_Release(&lv);
    if (have_rv) PyBuffer_Release(&rv);
    if (have_h) PyBuffer_Release(&hb);
    Py_XDECREF(got);
    Py_XDECREF(a);
    Py_XDECREF(plans);
    Py_XDECREF(plan);
    Py_XDECREF(last);
    Py_XDECREF(hmv);
    return res;
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)setup, METH_O, "Hand over the Python objects the calls read."},
    {"routed", (PyCFunction)(void (*)(void))routed, METH_FASTCALL,
     "routed(pool, experts, x, routes, weights, stream, device, what): a kept one-token "
     "routed call's Result, or None."},
    {"group", (PyCFunction)(void (*)(void))group, METH_FASTCALL,
     "group(pool, experts, rows, x, stream, device, what[, lend]): a kept expert group call's "
     "Result (its out the arena's own view with lend), or None."},
    {"matmul", (PyCFunction)(void (*)(void))matmul, METH_FASTCALL,
     "matmul(pool, w, x, stream, device, what): a kept matmul call's Result, or None."},
    {"ragged", (PyCFunction)(void (*)(void))ragged, METH_FASTCALL,
     "ragged(pool, kv_b, o_proj, q, caches, fresh, t_max, q_dim, rope_dim, v_dim, scale, "
     "latents, ropes, n_sm, stream, device, what): a kept ragged attention call's Result, or "
     "None."},
    {"rerun", (PyCFunction)(void (*)(void))rerun, METH_FASTCALL,
     "rerun(a, rep, stream, device, what[, lend]): cupy_calls.rerun."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kept", .m_size = -1, .m_methods = methods};

#define INTERN(var, text)                                                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__kept(void) {
    INTERN(s_group, "group");
    INTERN(s_group_shape, "group shape");
    INTERN(s_matmul, "matmul");
    INTERN(k_routes, "routes");
    INTERN(k_xv, "xv");
    INTERN(a_plans, "plans");
    INTERN(a_hmv, "hmv");
    INTERN(a_take, "take");
    INTERN(a_keep, "keep");
    INTERN(a_give_back, "give_back");
    INTERN(a_sptr, "sptr");
    INTERN(a_eptr, "eptr");
    INTERN(r_exec, "exec");
    INTERN(r_stamped, "stamped");
    INTERN(r_view, "view");
    INTERN(r_ptr, "ptr");
    INTERN(m_copy, "copy");
    INTERN(m_route_order, "ROUTE_ORDER");
    INTERN(m_poll, "POLL");
    INTERN(m_poll_ns, "POLL_NS");
    INTERN(m_pipeline, "PIPELINE");
    INTERN(m_pipe_bytes, "PIPE_BYTES");
    INTERN(m_graph_launch, "graphLaunch");
    INTERN(m_event_sync, "eventSynchronize");
    INTERN(t_parts, "parts");
    INTERN(t_cs, "cs");
    INTERN(t_cuts, "cuts");
    INTERN(t_nbytes, "nbytes");
    INTERN(s_out_features, "out_features");
    INTERN(s_data, "data");
    INTERN(s_latent, "latent");
    INTERN(s_rope, "rope");
    INTERN(s_length, "length");
    if ((one_int = PyLong_FromLong(1)) == NULL) return NULL;
    return PyModule_Create(&module);
}
