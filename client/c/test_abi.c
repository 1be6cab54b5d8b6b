/* test_abi: every entry point of libcoliworker_cuda.so against a live worker, each result
 * checked against a float64 reference (test_ref.c).
 *
 *   test_abi all        the whole ABI (tests/cclient/test_c_client.py starts the worker
 *                       with --devices 0,1 --max-experts 16 --max-sequences-per-call 4, so
 *                       groups and ragged calls are split into several calls too)
 *   test_abi restart    tensors, a sequence and an issue in flight, then "PAUSE restart":
 *                       the harness restarts the worker on the same ports and answers a
 *                       line; calls return 0, the library reconnects, and with
 *                       COLIWORKER_RETAIN=1 every result is right again
 *   test_abi multi      two workers in COLIWORKER_ADDRESS: device ids span both
 *   test_abi idle       a pause past the worker's --data-idle-timeout: the next call is
 *                       served on a new connection
 *
 * "PAUSE <what>" lines on stdout wait for one line on stdin (the harness looks at the
 * worker meanwhile). Exit status 0 when every check passed; failures are printed.
 *
 * This file owns main and the per-entry-point tests (init, test vectors, formats, dedup and
 * update, MLPs, expert groups, attention, ragged attention, refusals). The connection-level
 * tests (fault hook, threads, restart, multi, idle) are test_conn.c's; the CHECK harness,
 * the rng, host tensors, the reference and the shared fixtures are test_ref.c's (test_ref.h).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "coliworker_cuda.h"
#include "test_ref.h"

/* -- init, queries, test vectors ----------------------------------------------------- */

static void test_init(void) {
    int bad[2] = {0, 0}, big[1] = {99}, ok[2] = {0, 1};
    CHECK(!coli_cuda_init(NULL, 1), "init(NULL) must fail");
    CHECK(!coli_cuda_init(ok, 0), "init with 0 devices must fail");
    CHECK(!coli_cuda_init(bad, 2), "init with a duplicate device must fail");
    CHECK(!coli_cuda_init(big, 1), "init with device 99 must fail");
    CHECK(coli_cuda_init(ok, 2), "init {0, 1}");
    CHECK(coli_cuda_device_count() == 2, "device_count %d", coli_cuda_device_count());
    CHECK(coli_cuda_device_at(1) == 1 && coli_cuda_device_at(2) == -1, "device_at");
    size_t fr = 0, tot = 0;
    CHECK(coli_cuda_mem_info(0, &fr, &tot) && tot > 0 && fr <= tot, "mem_info %zu/%zu", fr, tot);
    CHECK(!coli_cuda_mem_info(5, &fr, &tot) && !coli_cuda_mem_info(0, NULL, &tot), "mem_info bad");
}

static void test_vectors(void) {
    /* the upstream engine's own vectors (NOTES.md) */
    uint8_t q2[4] = {0x70, 0xf8, 0xa9, 0xcb}, q3[2] = {0xe4, 0x1b};
    float s2[2] = {1.0f, 0.25f}, s3[2] = {0.5f, 2.0f}, x[4] = {1, -2, 3, -4}, y[2];
    ColiCudaTensor *t2 = NULL, *t3 = NULL;
    CHECK(coli_cuda_matmul(&t2, y, x, q2, s2, 2, 1, 4, 2, 0) && y[0] == -34.0f && y[1] == -2.5f,
          "fmt 2 vector: %g %g", y[0], y[1]);
    CHECK(coli_cuda_matmul(&t3, y, x, q3, s3, 3, 1, 4, 2, 1) && y[0] == -2.0f && y[1] == 12.0f,
          "fmt 3 vector: %g %g", y[0], y[1]);
    coli_cuda_tensor_free(t2);
    coli_cuda_tensor_free(t3);
}

/* -- tensors and matmul ---------------------------------------------------------------- */

static void test_formats(void) {
    static const int cases[][4] = {/* fmt, I, O, gs */
                                   {0, 37, 13, 0}, {1, 37, 13, 0}, {2, 37, 13, 0}, {3, 37, 13, 0},
                                   {4, 37, 13, 5}, {4, 38, 7, 8},  {4, 33, 9, 64}, {2, 1, 1, 0},
                                   {3, 5, 3, 0},   {4, 7, 5, 3},   {1, 129, 65, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int fmt = cases[c][0], I = cases[c][1], O = cases[c][2], gs = cases[c][3];
        int S = irange(1, 5), dev = (int)(c % 2);
        size_t n0, b0, n1, b1;
        stats(dev, &n0, &b0);
        Host h = make(fmt, I, O, gs);
        float *x = randn((size_t)S * I), *y = malloc((size_t)S * O * 4);
        double *ref = malloc((size_t)S * O * 8), *xd = to_double(x, (size_t)S * I);
        /* lazy upload on the first matmul (fmt 4 needs its group size: upload_g first) */
        if (fmt == 4) CHECK(upload(&h, dev), "upload_g fmt 4");
        CHECK(coli_cuda_matmul(&h.t, y, x, h.w, h.s, fmt, S, I, O, dev), "matmul fmt %d", fmt);
        ref_matmul(&h, xd, ref, S);
        char what[64];
        snprintf(what, sizeof what, "matmul fmt %d I=%d O=%d gs=%d S=%d", fmt, I, O, gs, S);
        CLOSE(what, y, ref, (size_t)S * O);
        size_t want = h.wb + h.ns * 4;
        CHECK(coli_cuda_tensor_bytes(h.t) == want, "tensor_bytes %zu, expected %zu",
              coli_cuda_tensor_bytes(h.t), want);
        CHECK(coli_cuda_tensor_device(h.t) == dev, "tensor_device");
        stats(dev, &n1, &b1);
        CHECK(n1 == n0 + 1 && b1 == b0 + want, "stats after upload: %zu/%zu -> %zu/%zu (+%zu)",
              n0, b0, n1, b1, want);
        /* the host's buffers go: the resident copy still serves */
        memset(h.w, 0x5a, h.wb);
        memset(h.s, 0, h.ns * 4);
        ColiCudaTensor *same = h.t;
        CHECK(coli_cuda_tensor_upload_g(&same, NULL, NULL, fmt, I, O, dev, gs) && same == h.t,
              "upload on an existing tensor with the same spec");
        CHECK(!coli_cuda_tensor_upload(&same, NULL, NULL, fmt == 1 ? 2 : 1, I, O, dev),
              "upload on an existing tensor with another fmt must fail");
        CHECK(!coli_cuda_tensor_upload(&same, NULL, NULL, fmt, I, O, 1 - dev),
              "upload on an existing tensor on another device must fail");
        memset(y, 0, (size_t)S * O * 4);
        CHECK(coli_cuda_matmul(&h.t, y, x, NULL, NULL, fmt, S, I, O, dev), "matmul, host freed");
        CLOSE(what, y, ref, (size_t)S * O);
        coli_cuda_tensor_free(h.t);
        h.t = NULL;
        stats(dev, &n1, &b1);
        CHECK(n1 == n0 && b1 == b0, "stats after free: %zu/%zu, expected %zu/%zu", n1, b1, n0, b0);
        drop(&h);
        free(x); free(y); free(ref); free(xd);
    }
}

static void test_dedup_update(void) {
    Host a = make(4, 40, 6, 16), b = a;
    size_t n0, b0, n1, b1;
    stats(-1, &n0, &b0);
    b.t = NULL;
    CHECK(upload(&a, 0) && upload(&b, 0) && a.t != b.t, "two uploads of one content");
    stats(-1, &n1, &b1);
    CHECK(n1 == n0 + 1 && b1 == b0 + a.wb + a.ns * 4,
          "identical content is resident once: %zu/%zu -> %zu/%zu", n0, b0, n1, b1);
    coli_cuda_tensor_free(b.t);
    float x[40], y[6];
    double xd[40], ref[6];
    for (int i = 0; i < 40; i++) xd[i] = x[i] = normal();
    CHECK(coli_cuda_matmul(&a.t, y, x, NULL, NULL, 4, 1, 40, 6, 0), "matmul after a twin's free");
    ref_matmul(&a, xd, ref, 1);
    CLOSE("dedup twin", y, ref, 6);
    /* update: new content under the same handle */
    Host c = make(4, 40, 6, 16);
    CHECK(coli_cuda_tensor_update(a.t, c.w, c.s), "update");
    CHECK(!coli_cuda_tensor_update(a.t, NULL, c.s) && !coli_cuda_tensor_update(a.t, c.w, NULL) &&
              !coli_cuda_tensor_update(NULL, c.w, c.s), "update with NULLs must fail");
    CHECK(coli_cuda_matmul(&a.t, y, x, NULL, NULL, 4, 1, 40, 6, 0), "matmul after update");
    ref_matmul(&c, xd, ref, 1);
    CLOSE("updated tensor", y, ref, 6);
    drop(&a);
    drop(&c);
    stats(-1, &n1, &b1);
    CHECK(n1 == n0 && b1 == b0, "stats back: %zu/%zu, expected %zu/%zu", n1, b1, n0, b0);
}

/* -- experts --------------------------------------------------------------------------- */

static void test_mlp(void) {
    int D = 24, I = 17, S = 3;
    Expert e = expert(D, I, 1, 1);
    float *x = randn((size_t)S * D), y[3 * 24];
    double ref[3 * 24];
    ref_mlp(&e.g, &e.u, &e.d, x, ref, S);
    CHECK(coli_cuda_expert_mlp(e.g.t, e.u.t, e.d.t, y, x, S), "expert_mlp");
    CLOSE("expert_mlp", y, ref, (size_t)S * D);
    CHECK(!coli_cuda_expert_mlp(e.g.t, e.u.t, e.g.t, y, x, S), "expert_mlp down=gate must fail");
    CHECK(!coli_cuda_expert_mlp(e.g.t, e.u.t, e.d.t, y, x, 0), "expert_mlp S=0 must fail");
    CHECK(!coli_cuda_shared_mlp_w4a16(e.g.t, e.u.t, e.d.t, y, x, S), "shared_mlp needs fmt 2");
    Host g = make(2, D, I, 0), u = make(2, D, I, 0), d = make(2, I, D, 0);
    CHECK(upload(&g, 0) && upload(&u, 0) && upload(&d, 0), "shared expert upload");
    ref_mlp(&g, &u, &d, x, ref, S);
    CHECK(coli_cuda_shared_mlp_w4a16(g.t, u.t, d.t, y, x, S), "shared_mlp_w4a16");
    CLOSE("shared_mlp_w4a16", y, ref, (size_t)S * D);
    CHECK(!coli_cuda_expert_mlp(g.t, u.t, e.d.t, y, x, S), "tensors on two devices must fail");
    drop(&g); drop(&u); drop(&d);
    drop_expert(&e);
    free(x);
}

static void test_groups(void) {
    static const int counts[] = {1, 2, 8, 17, 33, 64};
    uint64_t c0, e0, r0, c1, e1, r1;
    double h, k, d;
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        Group G;
        int n = counts[i];
        group_make(&G, n, 20, 12, (int)(i % 2), n > 8 ? 2 : 4);
        float *y = malloc((size_t)G.total * G.D * 4);
        coli_cuda_group_stats(&c0, &e0, &r0, &h, &k, &d);
        CHECK(coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, n, y, G.x), "expert_group %d", n);
        char what[64];
        snprintf(what, sizeof what, "expert_group of %d experts, %d rows", n, G.total);
        CLOSE(what, y, G.ref, (size_t)G.total * G.D);
        coli_cuda_group_stats(&c1, &e1, &r1, &h, &k, &d);
        CHECK(c1 > c0 && e1 == e0 + (uint64_t)n && r1 == r0 + (uint64_t)G.total,
              "group_stats: calls %llu->%llu experts %llu->%llu rows %llu->%llu",
              (unsigned long long)c0, (unsigned long long)c1, (unsigned long long)e0,
              (unsigned long long)e1, (unsigned long long)r0, (unsigned long long)r1);
        if (n == 8) {
            /* issue / take: bit-identical to the sync call, several outstanding */
            float *y2 = malloc((size_t)G.total * G.D * 4);
            float *x2 = randn((size_t)G.total * G.D);
            CHECK(coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, n, y2, x2), "sync x2");
            int dev = (int)(i % 2);
            CHECK(coli_cuda_expert_group_take(dev) == NULL, "take with nothing issued");
            CHECK(coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, n, G.x), "issue 1");
            CHECK(coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, n, x2), "issue 2");
            const float *a = coli_cuda_expert_group_take(dev),
                        *b = coli_cuda_expert_group_take(dev);
            size_t nb = (size_t)G.total * G.D * 4;
            CHECK(a && !memcmp(a, y, nb), "take 1 is bit-identical to expert_group");
            CHECK(b && !memcmp(b, y2, nb), "take 2 is bit-identical to expert_group");
            CHECK(a && !memcmp(a, y, nb), "take 1's pointer stays valid until the next issue");
            CHECK(coli_cuda_expert_group_take(dev) == NULL, "a third take has nothing");
            CHECK(coli_cuda_expert_group_take(7) == NULL, "take on an unknown device");
            free(y2);
            free(x2);
        }
        if (n == 17) /* the worker takes 16 per call (--max-experts 16): issue refuses */
            CHECK(!coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, n, G.x),
                  "issue over the worker's max_experts must fail");
        if (n == 64) {
            int r0s = G.rows[5];
            G.rows[5] = 0;
            CHECK(!coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, n, y, G.x), "rows 0 must fail");
            G.rows[5] = r0s;
            CHECK(!coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, 65, y, G.x), "65 must fail");
            ColiCudaTensor *keep = G.ds[3];
            G.ds[3] = G.gs[3];
            CHECK(!coli_cuda_expert_group(G.gs, G.us, G.ds, G.rows, n, y, G.x),
                  "a wrong down shape must fail");
            CHECK(!coli_cuda_expert_group_issue(G.gs, G.us, G.ds, G.rows, 8, G.x),
                  "issue with a wrong shape must fail");
            G.ds[3] = keep;
        }
        free(y);
        group_drop(&G);
    }
}

/* -- attention ------------------------------------------------------------------------- */

static void test_attention(void) {
    Host kvb = make(2, Kd, H * (Qd + Vd), 0), proj = make(4, H * Vd, Dout, 5);
    CHECK(upload(&kvb, 1) && upload(&proj, 1), "attention tensors");
    int T = 7, S = 3;
    float *lat = randn((size_t)T * Kd), *rope = randn((size_t)T * Rd);
    float *q = randn((size_t)S * H * (Qd + Rd));
    float out[3 * H * Vd > 3 * Dout ? 3 * H * Vd : 3 * Dout];
    double ref[3 * H * Vd > 3 * Dout ? 3 * H * Vd : 3 * Dout];
    const float *L[3] = {lat, lat, lat}, *Rp[3] = {rope, rope, rope};
    int n1[1] = {T}, nb[3] = {T - S + 1, T - S + 2, T - S + 3};
    CHECK(coli_cuda_attention_absorb(kvb.t, out, q, lat, rope, H, Qd, Rd, Vd, Kd, T, SCALE),
          "attention_absorb");
    ref_attention(&kvb, NULL, q, L, Rp, n1, 1, H, Qd, Rd, Vd, Kd, SCALE, ref);
    CLOSE("attention_absorb", out, ref, H * Vd);
    CHECK(coli_cuda_attention_absorb_batch(kvb.t, out, q, lat, rope, S, H, Qd, Rd, Vd, Kd, T,
                                           SCALE), "attention_absorb_batch");
    ref_attention(&kvb, NULL, q, L, Rp, nb, S, H, Qd, Rd, Vd, Kd, SCALE, ref);
    CLOSE("attention_absorb_batch (causal)", out, ref, (size_t)S * H * Vd);
    CHECK(coli_cuda_attention_project_batch(kvb.t, proj.t, out, q, lat, rope, S, H, Qd, Rd, Vd,
                                            Kd, T, SCALE), "attention_project_batch");
    ref_attention(&kvb, &proj, q, L, Rp, nb, S, H, Qd, Rd, Vd, Kd, SCALE, ref);
    CLOSE("attention_project_batch", out, ref, (size_t)S * Dout);
    CHECK(!coli_cuda_attention_absorb_batch(kvb.t, out, q, lat, rope, S, H, Qd, Rd, Vd, Kd, 2,
                                            SCALE), "T < S must fail");
    CHECK(!coli_cuda_attention_absorb(kvb.t, out, q, lat, rope, H + 1, Qd, Rd, Vd, Kd, T, SCALE),
          "a kv_b of another head count must fail");
    CHECK(!coli_cuda_attention_project_batch(kvb.t, kvb.t, out, q, lat, rope, S, H, Qd, Rd, Vd, Kd,
                                             T, SCALE), "an o_proj of another width must fail");
    CHECK(!coli_cuda_attention_absorb(kvb.t, out, q, lat, rope, H, Qd, Rd, Vd, Kd, T, NAN),
          "a NaN scale is the worker's INVALID_ARGUMENT: 0");
    drop(&kvb);
    drop(&proj);
    free(lat); free(rope); free(q);
}

static void test_ragged(void) {
    Host kvb = make(3, Kd, H * (Qd + Vd), 0), proj = make(1, H * Vd, Dout, 0);
    CHECK(upload(&kvb, 0) && upload(&proj, 0), "ragged tensors");
    enum { NS = 6, T = 64 };
    Seq seqs[NS];
    const void *keys[NS];
    int lens[NS] = {5, 1, 9, 3, 12, 2};
    for (int s = 0; s < NS; s++) { seq_init(&seqs[s], T, lens[s]); keys[s] = &seqs[s]; }
    /* six sequences: two calls on the worker (--max-sequences-per-call 4) */
    CHECK(ragged_step(&kvb, &proj, seqs, keys, NS, T, "ragged first call"), "ragged 1");
    for (int step = 0; step < 5; step++) {
        for (int s = 0; s < NS; s++) seqs[s].len++;
        CHECK(ragged_step(&kvb, &proj, seqs, keys, NS, T, "ragged decode step"), "ragged decode");
    }
    /* rollback: sequence 0 shrinks to 4 rows and gets a new row 3 */
    seqs[0].len = 4;
    for (int k = 0; k < Kd; k++) seqs[0].lat[3 * Kd + k] = normal();
    CHECK(ragged_step(&kvb, &proj, seqs, keys, NS, T, "ragged after rollback"), "rollback");
    /* a row rewritten in place while the length grows (the seed's stale cache) */
    for (int k = 0; k < Rd; k++) seqs[2].rope[(seqs[2].len - 1) * Rd + k] = normal();
    seqs[2].len++;
    CHECK(ragged_step(&kvb, &proj, seqs, keys, NS, T, "ragged after a rewrite"), "rewrite");
    /* the same call again: nothing new to send */
    CHECK(ragged_step(&kvb, &proj, seqs, keys, NS, T, "ragged repeated"), "repeat");
    /* a subset, in another order */
    Seq sub[3] = {seqs[4], seqs[1], seqs[3]};
    const void *subk[3] = {keys[4], keys[1], keys[3]};
    for (int s = 0; s < 3; s++) sub[s].len++;
    CHECK(ragged_step(&kvb, &proj, sub, subk, 3, T, "ragged subset"), "subset");
    seqs[4].len++; seqs[1].len++; seqs[3].len++;
    /* a key reused for new content (the engine freed a sequence and reused its memory) */
    Seq fresh;
    seq_init(&fresh, T, 7);
    Seq pair[2] = {fresh, seqs[5]};
    const void *pk[2] = {keys[0], keys[5]};
    CHECK(ragged_step(&kvb, &proj, pair, pk, 2, T, "ragged reused key"), "reused key");
    /* refusals change nothing the next call relies on */
    const float *L[2] = {seqs[1].lat, seqs[1].lat}, *Rp[2] = {seqs[1].rope, seqs[1].rope};
    const void *dup[2] = {keys[1], keys[1]};
    int n2[2] = {seqs[1].len, seqs[1].len}, nbad[1] = {T + 1}, nzero[1] = {0};
    float q[2 * H * (Qd + Rd)] = {0}, out[2 * Dout];
    CHECK(!coli_cuda_attention_project_ragged(kvb.t, proj.t, out, q, dup, L, Rp, n2, 2, H, Qd, Rd,
                                              Vd, Kd, T, SCALE), "duplicate keys must fail");
    CHECK(!coli_cuda_attention_project_ragged(kvb.t, proj.t, out, q, keys, L, Rp, nbad, 1, H, Qd,
                                              Rd, Vd, Kd, T, SCALE), "lengths > T must fail");
    CHECK(!coli_cuda_attention_project_ragged(kvb.t, proj.t, out, q, keys, L, Rp, nzero, 1, H, Qd,
                                              Rd, Vd, Kd, T, SCALE), "lengths 0 must fail");
    CHECK(!coli_cuda_attention_project_ragged(kvb.t, NULL, out, q, keys, L, Rp, n2, 1, H, Qd, Rd,
                                              Vd, Kd, T, SCALE), "no o_proj must fail");
    seqs[1].len += 2;
    const float *L1[1] = {seqs[1].lat}, *R1[1] = {seqs[1].rope};
    int n1[1] = {seqs[1].len};
    CHECK(!coli_cuda_attention_project_ragged(kvb.t, proj.t, out, q, &keys[1], L1, R1, n1, 1, H,
                                              Qd, Rd, Vd, Kd, T, NAN), "NaN scale: refused");
    CHECK(ragged_step(&kvb, &proj, seqs, keys + 1, NS - 1, T, "ragged after a refusal"),
          "after a refusal");
    /* idle sequences are freed (COLIWORKER_SEQ_IDLE_CALLS=8 here), come back from row 0 */
    for (int i = 0; i < 70; i++) {
        seqs[5].len = 2 + i % 40;
        CHECK(ragged_step(&kvb, &proj, &seqs[5], &keys[5], 1, T, "ragged alone"), "alone");
    }
    pause_for("idle-sequences"); /* the harness: only this kv_b's one busy sequence left */
    CHECK(ragged_step(&kvb, &proj, seqs + 1, keys + 1, 4, T, "ragged after idle free"), "back");
    for (int s = 0; s < NS; s++) { free(seqs[s].lat); free(seqs[s].rope); }
    free(fresh.lat);
    free(fresh.rope);
    drop(&kvb);
    drop(&proj);
}

/* -- refusals --------------------------------------------------------------------------- */

static void test_refusals(void) {
    size_t n0, b0, n1, b1;
    stats(-1, &n0, &b0);
    uint8_t w[64] = {1};
    float s[16] = {1}, x[16] = {1}, y[16];
    ColiCudaTensor *t = NULL;
    CHECK(!coli_cuda_tensor_upload(NULL, w, s, 2, 4, 2, 0), "upload into NULL");
    CHECK(!coli_cuda_tensor_upload(&t, NULL, s, 2, 4, 2, 0), "upload of NULL weights");
    CHECK(!coli_cuda_tensor_upload(&t, w, NULL, 2, 4, 2, 0), "upload without scales");
    CHECK(!coli_cuda_tensor_upload(&t, w, s, 5, 4, 2, 0), "upload of fmt 5");
    CHECK(!coli_cuda_tensor_upload(&t, w, s, 2, 0, 2, 0), "upload with I 0");
    CHECK(!coli_cuda_tensor_upload(&t, w, s, 2, 4, -1, 0), "upload with O -1");
    CHECK(!coli_cuda_tensor_upload(&t, w, s, 2, 4, 2, 9), "upload to device 9");
    CHECK(!coli_cuda_matmul(&t, y, x, w, s, 2, 0, 4, 2, 0), "matmul S 0");
    CHECK(!coli_cuda_matmul(&t, y, NULL, w, s, 2, 1, 4, 2, 0), "matmul x NULL");
    CHECK(!coli_cuda_matmul(NULL, y, x, w, s, 2, 1, 4, 2, 0), "matmul tensor NULL");
    CHECK(t == NULL, "nothing made");
    CHECK(!coli_cuda_expert_mlp(NULL, NULL, NULL, y, x, 1), "expert_mlp NULLs");
    CHECK(!coli_cuda_expert_group(NULL, NULL, NULL, NULL, 1, y, x), "expert_group NULLs");
    CHECK(!coli_cuda_expert_group_issue(NULL, NULL, NULL, NULL, 1, x), "issue NULLs");
    CHECK(!coli_cuda_attention_absorb(NULL, y, x, x, x, 1, 1, 1, 1, 1, 1, 1), "attention NULL");
    CHECK(coli_cuda_tensor_bytes(NULL) == 0 && coli_cuda_tensor_device(NULL) == -1, "NULL queries");
    coli_cuda_tensor_free(NULL);
    stats(-1, &n1, &b1);
    CHECK(n1 == n0 && b1 == b0, "refusals left residency alone: %zu/%zu -> %zu/%zu", n0, b0, n1,
          b1);
    /* the device-pointer family is not offered */
    CHECK(!coli_cuda_pipe_scratch(0, 0, 64) && !coli_cuda_pipe_alloc(0, 64) &&
              !coli_cuda_pipe_upload(0, y, x, 4) && !coli_cuda_pipe_sync(0) &&
              !coli_cuda_pipe_gemm(NULL, y, x, 1) &&
              !coli_cuda_attention_absorb_kvdev(NULL, y, x, x, x, 1, 1, 1, 1, 1, 1, 1),
          "device-pointer calls return 0 / NULL");
    coli_cuda_pipe_free(0, NULL);
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    const char *seed = getenv("TEST_ABI_SEED");
    rng_state = seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL) ^ (uint64_t)getpid() << 20;
    if (!rng_state) rng_state = 1;
    printf("test_abi %s: TEST_ABI_SEED=%llu\n", what, (unsigned long long)rng_state);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(what, "all")) {
        setenv("COLIWORKER_SEQ_IDLE_CALLS", "8", 1);
        test_init();
        test_vectors();
        test_formats();
        test_dedup_update();
        test_mlp();
        test_groups();
        test_attention();
        test_ragged();
        test_refusals();
        test_fault_hook();
        test_threads();
        pause_for("freed");
        coli_cuda_shutdown();
        float y[2], x[2] = {1, 1};
        ColiCudaTensor *t = NULL;
        CHECK(!coli_cuda_matmul(&t, y, x, x, NULL, 0, 1, 2, 1, 0), "calls after shutdown fail");
    } else if (!strcmp(what, "restart")) {
        test_restart();
    } else if (!strcmp(what, "multi")) {
        test_multi();
    } else if (!strcmp(what, "idle")) {
        test_idle();
    } else {
        fprintf(stderr, "usage: test_abi all|restart|multi|idle\n");
        return 2;
    }
    printf("%s: %d checks, %d failed\n", failures ? "FAILED" : "OK", checks, failures);
    return failures ? 1 : 0;
}
