/* test_ref.h: what the C client's test program shares across its files. test_ref.c owns
 * the CHECK / CLOSE harness and its counters, the xorshift rng (main seeds rng_state), the
 * PAUSE handshake, host tensors and the float64 reference, and the fixtures used by tests in
 * more than one file (experts, expert groups, ragged KV sequences). test_abi.c has main and
 * the per-entry-point tests; test_conn.c the connection-level tests declared at the end.
 */
#ifndef TEST_REF_H
#define TEST_REF_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "coliworker_cuda.h"

extern int failures, checks;
extern uint64_t rng_state;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        checks++;                                                         \
        if (!(cond)) {                                                    \
            failures++;                                                   \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                   \
            printf(__VA_ARGS__);                                          \
            printf("\n");                                                 \
            fflush(stdout);                                               \
        }                                                                 \
    } while (0)

float normal(void);
int irange(int lo, int hi);
float *randn(size_t n);

void pause_for(const char *what);

/* -- host tensors and the float64 reference ------------------------------------------ */

typedef struct {
    int fmt, I, O, gs;
    uint8_t *w;
    float *s;
    size_t wb, ns;
    double *deq; /* [O, I] */
    ColiCudaTensor *t;
} Host;

Host make(int fmt, int I, int O, int gs);
int upload(Host *h, int device);
void drop(Host *h);
/* y[S, O] = x[S, I] W^T */
void ref_matmul(const Host *h, const double *x, double *y, int S);
double *to_double(const float *x, size_t n);
void ref_mlp(const Host *g, const Host *u, const Host *d, const float *x, double *y, int S);
double rel_err(const float *y, const double *ref, size_t n);

#define TOL 2e-5
#define CLOSE(what, y, ref, n)                                                      \
    do {                                                                            \
        double e_ = rel_err((y), (ref), (n));                                       \
        CHECK(e_ < TOL, "%s: relative error %.3g (tolerance %.1g)", what, e_, TOL); \
    } while (0)
/* coli_cuda_matmul of resident h (no weights at hand; the call may refresh h->t) over x
 * [S, I] on device dev: CHECKs that it succeeds and CLOSEs its result to the reference; 1 if
 * both held. */
int check_matmul(Host *h, const float *x, int S, int dev, const char *what);

/* MLA absorbed attention: query row s of heads [nh, Q+R] sees rows [0, n[s]) of its cache. */
void ref_attention(const Host *kvb, const Host *proj, const float *q, const float *const *lat,
                   const float *const *rope, const int *n, int S, int nh, int Q, int R,
                   int V, int K, float scale, double *out);
void stats(int device, size_t *count, size_t *bytes);

/* -- experts --------------------------------------------------------------------------- */

typedef struct {
    Host g, u, d;
} Expert;

Expert expert(int D, int I, int k, int dev);
void drop_expert(Expert *e);

typedef struct {
    int n, D, I, total, rows[64];
    Expert e[64];
    ColiCudaTensor *gs[64], *us[64], *ds[64];
    float *x;
    double *ref;
} Group;

void group_make(Group *G, int n, int D, int I, int dev, int max_rows);
void group_drop(Group *G);

/* -- attention ------------------------------------------------------------------------- */

enum { H = 3, Qd = 8, Rd = 4, Vd = 6, Kd = 16, Dout = 10 };
extern const float SCALE; /* 1/sqrt(Q+R) */

typedef struct {
    float *lat, *rope;
    int len, cap;
} Seq;

void seq_init(Seq *s, int cap, int len);
/* one ragged step over seqs[0..S) with keys; checks against the reference */
int ragged_step(Host *kvb, Host *proj, Seq *seqs, const void **keys, int S, int T,
                const char *what);

/* -- the connection-level tests (test_conn.c) ------------------------------------------ */

void test_fault_hook(void);
void test_threads(void);
void test_restart(void);
void test_multi(void);
void test_idle(void);

#endif
