/* Configuration, the engine's devices, connection pools and reconnects.
 *
 * Each listed worker keeps a pool of idle data-plane connections; a call takes one (or
 * dials a new one), runs one exchange and gives it back, so calls from several engine
 * threads run side by side on separate connections. A broken connection marks its worker
 * down: calls to it return 0 at once while a background thread dials again (backing off
 * to 1 s). A new instance id in the WELCOME means the worker restarted: the epoch moves on,
 * which invalidates every handle and KV sequence of the old one; with COLIWORKER_RETAIN=1
 * the thread first uploads the host copies again (hash lookup first), then the worker is
 * up again. The device queries and stats of the ABI are in devices.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cw.h"

#ifdef COLIWORKER_WITH_TLS
#include <openssl/err.h>
#include <openssl/ssl.h>
SSL_CTX *cw_ssl_ctx;
#endif

cw_config cw_cfg;
int cw_nworkers;
cw_worker cw_workers[CW_MAX_WORKERS];
int cw_ndev;
cw_dev cw_devs[COLI_CUDA_MAX_DEVICES];
int cw_inited;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static uint64_t g_epochs;      /* epochs handed out (atomic) */
static unsigned g_generation;  /* init count: reconnect threads of an older one stop */
#define IDLE_KEEP 64

void cw_log(const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[coliworker] %s\n", line);
}

static void once(void) {
    for (int i = 0; i < CW_MAX_WORKERS; i++) {
        pthread_mutex_init(&cw_workers[i].mu, NULL);
        pthread_mutex_init(&cw_workers[i].reg_mu, NULL);
    }
    for (int i = 0; i < COLI_CUDA_MAX_DEVICES; i++) pthread_mutex_init(&cw_devs[i].mu, NULL);
}

uint64_t cw_new_epoch(void) { return __atomic_add_fetch(&g_epochs, 1, __ATOMIC_SEQ_CST); }

uint64_t cw_epoch_now(const cw_worker *w) { return __atomic_load_n(&w->epoch, __ATOMIC_ACQUIRE); }

cw_dev *cw_find_dev(int device) {
    for (int i = 0; i < cw_ndev; i++)
        if (cw_devs[i].id == device) return &cw_devs[i];
    return NULL;
}

/* -- configuration -------------------------------------------------------------------- */

static int env_int(const char *name, int dflt, int lo, int hi) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) {
        cw_log("%s: expected an integer %d..%d, got '%s'; using %d", name, lo, hi, v, dflt);
        return dflt;
    }
    return (int)x;
}

static void env_str(const char *name, char *out, size_t cap) {
    const char *v = getenv(name);
    out[0] = 0;
    if (v && strlen(v) < cap) strcpy(out, v);
}

/* The bearer token from COLIWORKER_TOKEN, else the first entry of COLIWORKER_TOKEN_FILE
 * ("name:token" or a bare token per line, as the worker's own file). */
static int read_token(void) {
    env_str("COLIWORKER_TOKEN", cw_cfg.token, sizeof cw_cfg.token);
    if (cw_cfg.token[0]) return 1;
    const char *path = getenv("COLIWORKER_TOKEN_FILE");
    if (!path || !*path) return 1;
    FILE *f = fopen(path, "r");
    if (!f) {
        cw_log("COLIWORKER_TOKEN_FILE: cannot read %s: %s", path, strerror(errno));
        return 0;
    }
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *s = line, *e;
        while (*s == ' ' || *s == '\t') s++;
        e = s + strlen(s);
        while (e > s && (e[-1] == '\n' || e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t')) *--e = 0;
        if (!*s || *s == '#') continue;
        char *colon = strchr(s, ':');
        strcpy(cw_cfg.token, colon ? colon + 1 : s);
        break;
    }
    fclose(f);
    if (!cw_cfg.token[0]) cw_log("COLIWORKER_TOKEN_FILE: %s holds no token", path);
    return cw_cfg.token[0] != 0;
}

static int read_config(void) {
    memset(&cw_cfg, 0, sizeof cw_cfg);
    cw_cfg.timeout_ms = env_int("COLIWORKER_TIMEOUT_MS", 60000, 1, 86400000);
    cw_cfg.spin_us = env_int("COLIWORKER_SPIN_US", 50, 0, 10000);
    cw_cfg.retain = env_int("COLIWORKER_RETAIN", 0, 0, 1);
    cw_cfg.seq_idle_calls = env_int("COLIWORKER_SEQ_IDLE_CALLS", 1024, 1, 1 << 30);
    cw_cfg.seq_max = env_int("COLIWORKER_SEQ_MAX", 4096, 1, 1 << 24);
    env_str("COLIWORKER_TLS_CA", cw_cfg.tls_ca, sizeof cw_cfg.tls_ca);
    env_str("COLIWORKER_TLS_CERT", cw_cfg.tls_cert, sizeof cw_cfg.tls_cert);
    env_str("COLIWORKER_TLS_KEY", cw_cfg.tls_key, sizeof cw_cfg.tls_key);
    cw_cfg.tls = cw_cfg.tls_ca[0] || cw_cfg.tls_cert[0] || env_int("COLIWORKER_TLS", 0, 0, 1);
    if (!cw_cfg.tls_cert[0] != !cw_cfg.tls_key[0]) {
        cw_log("COLIWORKER_TLS_CERT, COLIWORKER_TLS_KEY: expected both (mutual TLS) or neither");
        return 0;
    }
    if (!read_token()) return 0;
#ifdef COLIWORKER_WITH_TLS
    if (cw_cfg.tls) {
        if (!cw_ssl_ctx) {
            cw_ssl_ctx = SSL_CTX_new(TLS_client_method());
            if (!cw_ssl_ctx) return 0;
            SSL_CTX_set_min_proto_version(cw_ssl_ctx, TLS1_2_VERSION);
            int ok = cw_cfg.tls_ca[0]
                         ? SSL_CTX_load_verify_locations(cw_ssl_ctx, cw_cfg.tls_ca, NULL)
                         : SSL_CTX_set_default_verify_paths(cw_ssl_ctx);
            if (ok && cw_cfg.tls_cert[0])
                ok = SSL_CTX_use_certificate_chain_file(cw_ssl_ctx, cw_cfg.tls_cert) == 1 &&
                     SSL_CTX_use_PrivateKey_file(cw_ssl_ctx, cw_cfg.tls_key, SSL_FILETYPE_PEM) == 1;
            if (!ok) {
                char msg[256];
                ERR_error_string_n(ERR_get_error(), msg, sizeof msg);
                cw_log("TLS: cannot load COLIWORKER_TLS_CA / _CERT / _KEY: %s", msg);
                SSL_CTX_free(cw_ssl_ctx);
                cw_ssl_ctx = NULL;
                return 0;
            }
        }
    }
#else
    if (cw_cfg.tls) {
        cw_log("TLS is configured (COLIWORKER_TLS_*) but this library was built without it "
               "(rebuild with COLIWORKER_WITH_TLS=1 scripts/build-c)");
        return 0;
    }
#endif
    return 1;
}

static int parse_address(cw_worker *w, const char *a) {
    if (strlen(a) >= sizeof w->address) return 0;
    strcpy(w->address, a);
    if (!strncmp(a, "unix:", 5)) {
        w->is_unix = 1;
        strcpy(w->host, a + 5);
        return w->host[0] != 0;
    }
    w->is_unix = 0;
    const char *colon = strrchr(a, ':');
    if (!colon || colon == a) return 0;
    size_t hl = (size_t)(colon - a);
    if (a[0] == '[' && hl >= 2 && a[hl - 1] == ']') { a++; hl -= 2; }
    memcpy(w->host, a, hl);
    w->host[hl] = 0;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 1 || p > 65535) return 0;
    w->port = (int)p;
    return 1;
}

/* -- pools ---------------------------------------------------------------------------- */

static void *reconnect_main(void *arg);

void cw_mark_down(cw_worker *w) {
    cw_conn *idle;
    pthread_mutex_lock(&w->mu);
    int was_up = w->up;
    w->up = 0;
    idle = w->idle;
    w->idle = NULL;
    w->nidle = 0;
    int start = cw_inited && !w->reconnecting;
    if (start) w->reconnecting = 1;
    pthread_mutex_unlock(&w->mu);
    while (idle) {
        cw_conn *n = idle->next;
        cw_close(idle);
        idle = n;
    }
    if (was_up) cw_log("%s: connection lost; calls fall back to the CPU until it is back",
                       w->address);
    if (start) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        uintptr_t arg = (uintptr_t)w->index | (uintptr_t)g_generation << 8;
        if (pthread_create(&t, &at, reconnect_main, (void *)arg)) {
            pthread_mutex_lock(&w->mu);
            w->reconnecting = 0;
            pthread_mutex_unlock(&w->mu);
        }
        pthread_attr_destroy(&at);
    }
}

cw_conn *cw_acquire(cw_worker *w) {
    char instance[80];
    pthread_mutex_lock(&w->mu);
    if (!w->up) {
        pthread_mutex_unlock(&w->mu);
        return NULL;
    }
    memcpy(instance, w->instance, sizeof instance);
    cw_conn *c;
    while ((c = w->idle)) {
        w->idle = c->next;
        w->nidle--;
        if (cw_alive(c)) break;
        cw_close(c); /* the worker closed it while it sat in the pool (--data-idle-timeout) */
    }
    pthread_mutex_unlock(&w->mu);
    if (c) return c;
    c = cw_connect(w, 1);
    if (!c || strcmp(c->instance, instance)) { /* gone, or restarted: the thread sorts it */
        cw_close(c);
        cw_mark_down(w);
        return NULL;
    }
    return c;
}

int cw_release(cw_conn *c, int code) {
    cw_worker *w = c->w;
    if (code < 0) {
        cw_close(c);
        if (code == CW_IO) cw_mark_down(w);
        return 0;
    }
    pthread_mutex_lock(&w->mu);
    if (w->up && w->nidle < IDLE_KEEP) {
        c->next = w->idle;
        w->idle = c;
        w->nidle++;
        c = NULL;
    }
    pthread_mutex_unlock(&w->mu);
    cw_close(c);
    return code == 0;
}

/* -- reconnecting --------------------------------------------------------------------- */

static int current(unsigned gen) { return __atomic_load_n(&g_generation, __ATOMIC_ACQUIRE) == gen; }

static void sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) && errno == EINTR) {}
}

/* The worker came back as a new instance: its handles are gone. Host copies go up again
 * (under reg_mu, so a free waits); the others stay stale (calls on them return 0, and an
 * upload of the same tensor by the engine puts it back). */
static int restore(cw_conn *c, cw_worker *w, uint64_t epoch) {
    int restored = 0, stale = 0;
    for (ColiCudaTensor *t = w->tensors; t; t = t->next) {
        if (!t->host) { stale++; continue; }
        uint64_t h = 0;
        int rc = cw_put(c, t, t->host, t->host + t->wbytes, &h);
        if (rc < 0) return rc;
        if (rc == 0) {
            __atomic_store_n(&t->handle, h, __ATOMIC_RELAXED);
            __atomic_store_n(&t->epoch, epoch, __ATOMIC_RELEASE);
            restored++;
        } else {
            stale++;
        }
    }
    cw_log("%s: worker restarted; %d tensors uploaded again, %d lost%s", w->address, restored,
           stale, stale && !cw_cfg.retain ? " (COLIWORKER_RETAIN=1 keeps host copies)" : "");
    return 0;
}

static void *reconnect_main(void *arg) {
    uintptr_t a = (uintptr_t)arg;
    cw_worker *w = &cw_workers[a & 0xff];
    unsigned gen = (unsigned)(a >> 8);
    int delay = 20;
    while (current(gen)) {
        for (int slept = 0; slept < delay && current(gen); slept += 10) sleep_ms(10);
        if (delay < 1000) delay *= 2;
        if (!current(gen)) break;
        cw_conn *c = cw_connect(w, 1);
        if (!c) continue;
        cw_dev_info devs[COLI_CUDA_MAX_DEVICES];
        int ndev;
        if (cw_info(c, w, devs, &ndev)) { cw_close(c); continue; }
        pthread_mutex_lock(&w->reg_mu);
        int restarted = strcmp(c->instance, w->instance) != 0;
        int rc = 0;
        if (restarted) {
            uint64_t epoch = cw_new_epoch();
            rc = restore(c, w, epoch);
            if (rc == 0) {
                for (int i = 0; i < 6; i++) { w->gbase[i] += w->glast[i]; w->glast[i] = 0; }
                w->ndfree = 0;
                pthread_mutex_lock(&w->mu);
                memcpy(w->instance, c->instance, sizeof w->instance);
                pthread_mutex_unlock(&w->mu);
                __atomic_store_n(&w->epoch, epoch, __ATOMIC_RELEASE);
            }
        } else {
            /* the same instance: frees asked for while it was unreachable go now */
            for (size_t i = 0; i < w->ndfree && rc >= 0; i++) {
                cw_begin(c);
                pb_uint(&c->req, 1, w->dfree[i]);
                rc = cw_exchange(c, M_FREE, NULL, 0);
            }
            if (rc >= 0) { w->ndfree = 0; rc = 0; }
        }
        pthread_mutex_unlock(&w->reg_mu);
        if (rc < 0 || !current(gen)) { cw_close(c); continue; }
        pthread_mutex_lock(&w->mu);
        c->next = w->idle;
        w->idle = c;
        w->nidle++;
        w->up = 1;
        w->reconnecting = 0;
        pthread_mutex_unlock(&w->mu);
        cw_log("%s: connected again%s", w->address, restarted ? " (a new worker instance)" : "");
        return NULL;
    }
    pthread_mutex_lock(&w->mu);
    w->reconnecting = 0;
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* -- init / shutdown ------------------------------------------------------------------ */

static void close_all(void) {
    __atomic_add_fetch(&g_generation, 1, __ATOMIC_RELEASE); /* reconnect threads stop */
    cw_inited = 0;
    for (int i = 0; i < cw_ndev; i++) cw_devq_drain(&cw_devs[i]);
    for (int i = 0; i < cw_nworkers; i++) {
        cw_worker *w = &cw_workers[i];
        pthread_mutex_lock(&w->mu);
        w->up = 0;
        cw_conn *idle = w->idle;
        w->idle = NULL;
        w->nidle = 0;
        pthread_mutex_unlock(&w->mu);
        while (idle) {
            cw_conn *n = idle->next;
            cw_close(idle);
            idle = n;
        }
    }
    for (int waited = 0; waited < 10000; waited += 10) { /* threads notice within ~10 ms */
        int busy = 0;
        for (int i = 0; i < cw_nworkers; i++) {
            pthread_mutex_lock(&cw_workers[i].mu);
            busy |= cw_workers[i].reconnecting;
            pthread_mutex_unlock(&cw_workers[i].mu);
        }
        if (!busy) break;
        sleep_ms(10);
    }
    cw_ndev = 0;
}

int coli_cuda_init(const int *devices, int count) {
    pthread_once(&g_once, once);
    if (!devices || count < 1 || count > COLI_CUDA_MAX_DEVICES) return 0;
    pthread_mutex_lock(&g_mu);
    if (cw_inited || cw_nworkers) close_all();
    if (!read_config()) goto fail;
    const char *list = getenv("COLIWORKER_ADDRESS");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", list && *list ? list : "127.0.0.1:50052");
    cw_nworkers = 0;
    int total = 0;
    for (char *save = NULL, *a = strtok_r(buf, ",", &save); a; a = strtok_r(NULL, ",", &save)) {
        while (*a == ' ') a++;
        if (!*a) continue;
        if (cw_nworkers == CW_MAX_WORKERS) {
            cw_log("COLIWORKER_ADDRESS: expected at most %d workers", CW_MAX_WORKERS);
            goto fail;
        }
        cw_worker *w = &cw_workers[cw_nworkers];
        pthread_mutex_lock(&w->reg_mu);
        w->ndfree = 0;
        pthread_mutex_unlock(&w->reg_mu);
        w->index = cw_nworkers++;
        memset(w->gbase, 0, sizeof w->gbase);
        memset(w->glast, 0, sizeof w->glast);
        if (!parse_address(w, a)) {
            cw_log("COLIWORKER_ADDRESS: expected host:port or unix:/path, got '%s'", a);
            goto fail;
        }
        cw_conn *c = cw_connect(w, 0);
        if (!c) goto fail;
        cw_dev_info devs[COLI_CUDA_MAX_DEVICES];
        int ndev = 0;
        w->max_experts = 64;
        w->max_seqs = 1024;
        if (cw_info(c, w, devs, &ndev) || ndev < 1) {
            cw_log("%s: no devices in its Info reply", w->address);
            cw_close(c);
            goto fail;
        }
        w->ndev = ndev;
        w->first = total;
        for (int i = 0; i < ndev; i++) w->rdev[i] = devs[i].id;
        total += ndev;
        memcpy(w->instance, c->instance, sizeof w->instance);
        w->epoch = cw_new_epoch();
        w->up = 1;
        w->reconnecting = 0;
        c->next = NULL;
        w->idle = c;
        w->nidle = 1;
    }
    if (total > COLI_CUDA_MAX_DEVICES) total = COLI_CUDA_MAX_DEVICES;
    for (int i = 0; i < count; i++) {
        int d = devices[i];
        if (d < 0 || d >= total) {
            cw_log("invalid device %d (available: 0..%d over %d workers)", d, total - 1,
                   cw_nworkers);
            goto fail;
        }
        for (int j = 0; j < i; j++)
            if (devices[j] == d) {
                cw_log("duplicate device %d", d);
                goto fail;
            }
        cw_worker *w = NULL;
        for (int k = 0; k < cw_nworkers; k++)
            if (d >= cw_workers[k].first && d < cw_workers[k].first + cw_workers[k].ndev)
                w = &cw_workers[k];
        cw_dev *dv = &cw_devs[i];
        dv->id = d;
        dv->w = w;
        dv->rdev = w->rdev[d - w->first];
        dv->head = dv->tail = NULL;
        dv->npend = 0;
        cw_log("device %d: %s device %d", d, w->address, dv->rdev);
    }
    cw_ndev = count;
    cw_inited = 1;
    pthread_mutex_unlock(&g_mu);
    return 1;
fail:
    close_all();
    cw_nworkers = 0;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

void coli_cuda_shutdown(void) {
    pthread_once(&g_once, once);
    pthread_mutex_lock(&g_mu);
    close_all();
    pthread_mutex_unlock(&g_mu);
}
