/* test_conn: test_abi's connection-level tests (declared in test_ref.h, run by main in
 * test_abi.c): the COLI_GPU_FAIL_AFTER fault hook, calls from several threads at once, a
 * worker restarted mid-run ("test_abi restart"), two workers in COLIWORKER_ADDRESS
 * ("multi") and pooled connections the worker closed while idle ("idle"). The harness,
 * the float64 reference and the shared fixtures are test_ref.c's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "test_ref.h"

/* -- the fault hook, threads ------------------------------------------------------------- */

void test_fault_hook(void) {
    Host h = make(2, 16, 4, 0);
    float x[16], y[4];
    for (int i = 0; i < 16; i++) x[i] = normal();
    CHECK(upload(&h, 0), "upload");
    setenv("COLI_GPU_FAIL_AFTER", "3", 1);
    int ok = 0;
    for (int i = 0; i < 3; i++) ok += coli_cuda_matmul(&h.t, y, x, NULL, NULL, 2, 1, 16, 4, 0);
    CHECK(ok == 3, "COLI_GPU_FAIL_AFTER=3: 3 calls pass, got %d", ok);
    CHECK(!coli_cuda_matmul(&h.t, y, x, NULL, NULL, 2, 1, 16, 4, 0), "the 4th call fails");
    Host u = make(1, 8, 3, 0);
    CHECK(upload(&u, 1), "uploads are not gated");
    setenv("COLI_GPU_FAIL_AFTER", "0", 1);
    CHECK(!coli_cuda_matmul(&h.t, y, x, NULL, NULL, 2, 1, 16, 4, 0), "FAIL_AFTER=0 fails all");
    unsetenv("COLI_GPU_FAIL_AFTER");
    CHECK(coli_cuda_matmul(&h.t, y, x, NULL, NULL, 2, 1, 16, 4, 0), "unset: calls pass again");
    drop(&h);
    drop(&u);
}

typedef struct {
    Group *G;
    Host *m;
    int ok, bad;
} Job;

static void *worker_thread(void *arg) {
    Job *j = arg;
    Group *G = j->G;
    float *y = malloc((size_t)G->total * G->D * 4);
    float x[24], ym[8];
    double xd[24], ref[8];
    for (int i = 0; i < 24; i++) xd[i] = x[i] = (float)i / 7 - 1;
    ref_matmul(j->m, xd, ref, 1);
    for (int it = 0; it < 25; it++) {
        if (coli_cuda_expert_group(G->gs, G->us, G->ds, G->rows, G->n, y, G->x) &&
            rel_err(y, G->ref, (size_t)G->total * G->D) < TOL)
            j->ok++;
        else
            j->bad++;
        if (coli_cuda_matmul(&j->m->t, ym, x, NULL, NULL, j->m->fmt, 1, 24, 8, 0) &&
            rel_err(ym, ref, 8) < TOL)
            j->ok++;
        else
            j->bad++;
    }
    free(y);
    return NULL;
}

void test_threads(void) {
    Group G;
    group_make(&G, 8, 20, 12, 1, 3);
    Host m = make(4, 24, 8, 6);
    CHECK(upload(&m, 0), "upload");
    pthread_t th[4];
    Job jobs[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (Job){&G, &m, 0, 0};
        pthread_create(&th[i], NULL, worker_thread, &jobs[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(jobs[i].bad == 0 && jobs[i].ok == 50, "thread %d: %d right, %d wrong", i,
              jobs[i].ok, jobs[i].bad);
    }
    drop(&m);
    group_drop(&G);
}

/* -- restart ---------------------------------------------------------------------------- */

static int until_ok(int (*fn)(void *), void *arg, double seconds) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (fn(arg)) return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 > seconds) return 0;
        usleep(20000);
    }
}

static Host *g_probe;
static int probe_upload(void *arg) {
    (void)arg;
    Host *p = g_probe;
    coli_cuda_tensor_free(p->t);
    p->t = NULL;
    return upload(p, 0);
}

static int probe_group(void *arg) {
    Group *G = arg;
    float *y = malloc((size_t)G->total * G->D * 4);
    int ok = coli_cuda_expert_group(G->gs, G->us, G->ds, G->rows, G->n, y, G->x);
    free(y);
    return ok;
}

void test_restart(void) {
    int devs[2] = {0, 1};
    int retain = getenv("COLIWORKER_RETAIN") && atoi(getenv("COLIWORKER_RETAIN"));
    CHECK(coli_cuda_init(devs, 2), "init");
    Group G;
    group_make(&G, 4, 20, 12, 1, 2);
    Host m = make(2, 24, 8, 0), probe = make(0, 4, 2, 0);
    Host kvb = make(2, Kd, H * (Qd + Vd), 0), proj = make(2, H * Vd, Dout, 0);
    CHECK(upload(&m, 0) && upload(&kvb, 0) && upload(&proj, 0), "uploads");
    float *y = malloc((size_t)G.total * G.D * 4), x[24], ym[8];
    double xd[24], ref[8];
    for (int i = 0; i < 24; i++) xd[i] = x[i] = normal();
    ref_matmul(&m, xd, ref, 1);
    CHECK(coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, G.n, y, G.x), "group before");
    Seq sq;
    seq_init(&sq, 32, 6);
    const void *key = &sq;
    CHECK(ragged_step(&kvb, &proj, &sq, &key, 1, 32, "ragged before"), "ragged before");
    CHECK(coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, G.n, G.x), "issue before");
    uint64_t c0, c1;
    coli_cuda_group_stats(&c0, NULL, NULL, NULL, NULL, NULL);
    pause_for("restart");
    const float *early = coli_cuda_expert_group_take(1); /* answered before the kill, or not */
    CHECK(!early || rel_err(early, G.ref, (size_t)G.total * G.D) < TOL,
          "a take across the restart: the result it had, or none");
    CHECK(!coli_cuda_matmul(&m.t, ym, x, NULL, NULL, 2, 1, 24, 8, 0), "the first call returns 0");
    g_probe = &probe;
    CHECK(until_ok(probe_upload, NULL, 30), "the library reconnects");
    if (retain) {
        CHECK(until_ok(probe_group, &G, 30), "retained experts compute again");
        CHECK(coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, G.n, y, G.x), "group after");
        CLOSE("expert_group after restart", y, G.ref, (size_t)G.total * G.D);
        CHECK(coli_cuda_matmul(&m.t, ym, x, NULL, NULL, 2, 1, 24, 8, 0), "matmul after");
        CLOSE("matmul after restart", ym, ref, 8);
    } else {
        CHECK(!probe_group(&G), "without COLIWORKER_RETAIN the old handles are gone");
        CHECK(coli_cuda_matmul(&m.t, ym, x, m.w, m.s, 2, 1, 24, 8, 0),
              "matmul with the weights at hand uploads them again");
        CLOSE("matmul after restart", ym, ref, 8);
        for (int c = 0; c < G.n; c++)
            CHECK(upload(&G.e[c].g, 1) && upload(&G.e[c].u, 1) && upload(&G.e[c].d, 1),
                  "the engine's upload puts a lost tensor back");
        CHECK(upload(&kvb, 0) && upload(&proj, 0), "attention tensors back");
        CHECK(coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, G.n, y, G.x), "group after");
        CLOSE("expert_group after re-upload", y, G.ref, (size_t)G.total * G.D);
    }
    sq.len++;
    CHECK(ragged_step(&kvb, &proj, &sq, &key, 1, 32, "ragged after restart"), "ragged after");
    CHECK(coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, G.n, G.x), "issue after");
    const float *t = coli_cuda_expert_group_take(1);
    CHECK(t && rel_err(t, G.ref, (size_t)G.total * G.D) < TOL, "take after restart");
    coli_cuda_group_stats(&c1, NULL, NULL, NULL, NULL, NULL);
    CHECK(c1 >= c0, "group_stats do not go back across a restart: %llu -> %llu",
          (unsigned long long)c0, (unsigned long long)c1);
    free(y);
    free(sq.lat);
    free(sq.rope);
    drop(&m); drop(&probe); drop(&kvb); drop(&proj);
    group_drop(&G);
    pause_for("freed");
    coli_cuda_shutdown();
}

/* -- several workers ---------------------------------------------------------------------- */

void test_multi(void) {
    int devs[3] = {2, 0, 1};
    CHECK(coli_cuda_init(devs, 3), "init over two workers");
    CHECK(coli_cuda_device_count() == 3 && coli_cuda_device_at(0) == 2, "device list");
    Host a = make(4, 30, 5, 4), b = make(1, 30, 5, 0);
    size_t n0, b0, n2, b2;
    stats(0, &n0, &b0);
    CHECK(upload(&a, 2) && upload(&b, 0), "uploads to both workers");
    stats(2, &n2, &b2);
    CHECK(n2 == 1 && b2 == a.wb + a.ns * 4, "device 2 is the second worker's: %zu/%zu", n2, b2);
    float x[60], y[10];
    for (int i = 0; i < 60; i++) x[i] = normal();
    check_matmul(&a, x, 2, 2, "matmul on the second worker");
    check_matmul(&b, x, 2, 0, "matmul on the first worker");
    CHECK(!coli_cuda_expert_mlp(a.t, b.t, a.t, y, x, 1), "tensors of two workers must fail");
    drop(&a);
    drop(&b);
    coli_cuda_shutdown();
    CHECK(coli_cuda_device_count() == 0, "shutdown");
}

/* The worker closes data-plane connections idle for --data-idle-timeout (the harness starts
 * it with 1 s): after a longer pause the library finds its pooled connections closed and
 * dials new ones, so the call is served, not refused. */
void test_idle(void) {
    int devs[1] = {0};
    CHECK(coli_cuda_init(devs, 1), "init");
    Host a = make(2, 30, 5, 0);
    CHECK(upload(&a, 0), "upload");
    float x[60];
    for (int i = 0; i < 60; i++) x[i] = normal();
    check_matmul(&a, x, 2, 0, "matmul before the pause");
    struct timespec t = {2, 500000000L};
    while (nanosleep(&t, &t) && errno == EINTR) {}
    check_matmul(&a, x, 2, 0, "matmul after the worker closed the idle connections");
    drop(&a);
    coli_cuda_shutdown();
}
