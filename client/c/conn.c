/* One data-plane connection (proto/FRAMES.md): TCP with TCP_NODELAY, or a Unix socket,
 * optionally TLS (built with COLIWORKER_WITH_TLS=1); the HELLO / WELCOME handshake; CALL
 * frames written straight from the caller's arrays (sendmsg over iovecs, no copy) and
 * REPLY frames read straight into the caller's output.
 *
 * The socket is non-blocking: a reader polls it for COLIWORKER_SPIN_US before it sleeps in
 * poll() (waking a sleeping thread costs tens of microseconds, a decode call's budget), and
 * every wait ends after COLIWORKER_TIMEOUT_MS without progress (CW_IO).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cw.h"

#ifdef COLIWORKER_WITH_TLS
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
extern SSL_CTX *cw_ssl_ctx; /* workers.c, made at init when TLS is configured */
#endif

#define HELLO 1
#define WELCOME 2
#define CALL 3
#define REPLY 4
#define MAX_BODY (4u << 20)
#define CONNECT_TIMEOUT_MS 5000

static const uint8_t ZEROS[CW_ALIGN];

const char *cw_method_name(int m) {
    static const char *names[] = {"?", "info", "lookup", "upload", "update", "free", "stats",
                                  "matmul", "expert_mlp", "expert_group", "?", "?", "?",
                                  "attention", "attention_ragged", "free_sequence"};
    return m >= 0 && m < (int)(sizeof names / sizeof *names) ? names[m] : "?";
}

static uint64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
}

static int wait_io(int fd, short ev, int timeout_ms) {
    struct pollfd p = {fd, ev, 0};
    for (;;) {
        int k = poll(&p, 1, timeout_ms);
        if (k > 0) return 0;
        if (k == 0 || errno != EINTR) return CW_IO;
    }
}

/* -- raw reads and writes ------------------------------------------------------------- */

static int rd(cw_conn *c, void *buf, size_t n) {
    uint8_t *p = buf;
    size_t got = 0;
    uint64_t spin_end = 0;
    while (got < n) {
#ifdef COLIWORKER_WITH_TLS
        if (c->ssl) {
            size_t want = n - got > INT_MAX ? INT_MAX : n - got;
            int k = SSL_read(c->ssl, p + got, (int)want);
            if (k > 0) { got += (size_t)k; continue; }
            int e = SSL_get_error(c->ssl, k);
            if (e == SSL_ERROR_WANT_READ) {
                if (wait_io(c->fd, POLLIN, cw_cfg.timeout_ms)) return CW_IO;
                continue;
            }
            if (e == SSL_ERROR_WANT_WRITE) {
                if (wait_io(c->fd, POLLOUT, cw_cfg.timeout_ms)) return CW_IO;
                continue;
            }
            return CW_IO;
        }
#endif
        ssize_t k = recv(c->fd, p + got, n - got, 0);
        if (k > 0) { got += (size_t)k; spin_end = 0; continue; }
        if (k == 0) return CW_IO;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return CW_IO;
        if (cw_cfg.spin_us > 0) {
            uint64_t t = now_us();
            if (!spin_end) spin_end = t + (uint64_t)cw_cfg.spin_us;
            if (t < spin_end) { sched_yield(); continue; }
        }
        if (wait_io(c->fd, POLLIN, cw_cfg.timeout_ms)) return CW_IO;
        spin_end = 0;
    }
    return 0;
}

static int discard(cw_conn *c, uint64_t n) {
    uint8_t buf[65536];
    while (n) {
        size_t k = n > sizeof buf ? sizeof buf : (size_t)n;
        if (rd(c, buf, k)) return CW_IO;
        n -= k;
    }
    return 0;
}

#ifdef COLIWORKER_WITH_TLS
/* SSL_write on a socket whose peer is gone raises SIGPIPE: keep it from the engine. */
static int tls_write(cw_conn *c, const void *p, size_t n) {
    sigset_t pipe_set, old;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    int rc = 0;
    const uint8_t *b = p;
    while (n && !rc) {
        int k = SSL_write(c->ssl, b, (int)(n > (1u << 30) ? (1u << 30) : n));
        if (k > 0) { b += k; n -= (size_t)k; continue; }
        int e = SSL_get_error(c->ssl, k);
        if (e == SSL_ERROR_WANT_WRITE) rc = wait_io(c->fd, POLLOUT, cw_cfg.timeout_ms);
        else if (e == SSL_ERROR_WANT_READ) rc = wait_io(c->fd, POLLIN, cw_cfg.timeout_ms);
        else rc = CW_IO;
    }
    struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_set, NULL, &zero) > 0) {} /* drop a SIGPIPE we caused */
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}
#endif

/* Write every byte of iov[0..n) (the array is consumed). */
static int wr(cw_conn *c, struct iovec *iov, int n) {
#ifdef COLIWORKER_WITH_TLS
    if (c->ssl) {
        for (int i = 0; i < n; i++)
            if (iov[i].iov_len && tls_write(c, iov[i].iov_base, iov[i].iov_len)) return CW_IO;
        return 0;
    }
#endif
    while (n > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)(n > 1024 ? 1024 : n);
        ssize_t k = sendmsg(c->fd, &m, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (wait_io(c->fd, POLLOUT, cw_cfg.timeout_ms)) return CW_IO;
                continue;
            }
            return CW_IO;
        }
        size_t left = (size_t)k;
        while (n > 0 && left >= iov->iov_len) { left -= iov->iov_len; iov++; n--; }
        if (n > 0 && left) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* -- frames --------------------------------------------------------------------------- */

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void header(uint8_t h[32], int type, int method, uint64_t rid, uint32_t body,
                   uint64_t data) {
    memcpy(h, "CWF1", 4);
    h[4] = (uint8_t)type;
    h[5] = 0;
    put_le(h + 6, (uint64_t)method, 2);
    put_le(h + 8, rid, 8);
    put_le(h + 16, 0, 4);
    put_le(h + 20, body, 4);
    put_le(h + 24, data, 8);
}

static int push_iov(cw_conn *c, const void *p, size_t n) {
    if (c->niov == c->iov_cap) {
        int cap = c->iov_cap ? 2 * c->iov_cap : 64;
        struct iovec *v = realloc(c->iov, (size_t)cap * sizeof *v);
        if (!v) return 0;
        c->iov = v;
        c->iov_cap = cap;
    }
    c->iov[c->niov].iov_base = (void *)p;
    c->iov[c->niov].iov_len = n;
    c->niov++;
    return 1;
}

void cw_begin(cw_conn *c) {
    pb_reset(&c->req);
    c->niov = 0;
    c->data_off = 0;
    c->status = 0;
    /* slots 0 and 1: the header and the body */
    if (!push_iov(c, NULL, 0) || !push_iov(c, NULL, 0)) c->req.oom = 1;
}

uint64_t cw_place(cw_conn *c, const void *p, size_t n) {
    size_t pad = (size_t)(-c->data_off & (CW_ALIGN - 1));
    if (pad && !push_iov(c, ZEROS, pad)) c->req.oom = 1;
    uint64_t off = c->data_off + pad;
    if (n && !push_iov(c, p, n)) c->req.oom = 1;
    c->data_off = off + n;
    return off;
}

int cw_append(cw_conn *c, const void *p, size_t n) {
    if (n && !push_iov(c, p, n)) { c->req.oom = 1; return 0; }
    c->data_off += n;
    return 1;
}

static int send_frame(cw_conn *c, int type, int method, uint64_t rid) {
    uint8_t h[32];
    if (c->req.oom || c->req.n > MAX_BODY) return CW_PROTO;
    header(h, type, method, rid, (uint32_t)c->req.n, c->data_off);
    c->iov[0].iov_base = h;
    c->iov[0].iov_len = 32;
    c->iov[1].iov_base = c->req.p;
    c->iov[1].iov_len = c->req.n;
    return wr(c, c->iov, c->niov);
}

uint64_t cw_send_call(cw_conn *c, int method) {
    int upload = method == M_UPLOAD || method == M_UPDATE;
    if (!upload && c->max_frame && c->req.n + c->data_off > c->max_frame) {
        cw_log("%s: a frame of %llu bytes exceeds the worker's max_frame_bytes %llu",
               cw_method_name(method), (unsigned long long)(c->req.n + c->data_off),
               (unsigned long long)c->max_frame);
        c->status = CW_PROTO;
        return 0;
    }
    uint64_t rid = ++c->rid;
    int rc = send_frame(c, CALL, method, rid);
    if (rc) { c->status = rc; return 0; }
    return rid;
}

static int body_room(cw_conn *c, size_t n) {
    if (n <= c->body_cap) return 1;
    uint8_t *b = realloc(c->body, n);
    if (!b) return 0;
    c->body = b;
    c->body_cap = n;
    return 1;
}

/* Read one frame header and its body; the data is left for the caller. */
static int read_head(cw_conn *c, int *type, int *method, uint64_t *rid, uint32_t *status,
                     uint64_t *data) {
    uint8_t h[32];
    if (rd(c, h, 32)) return CW_IO;
    if (memcmp(h, "CWF1", 4) || h[5]) return CW_PROTO;
    *type = h[4];
    *method = (int)get_le(h + 6, 2);
    *rid = get_le(h + 8, 8);
    *status = (uint32_t)get_le(h + 16, 4);
    uint32_t body = (uint32_t)get_le(h + 20, 4);
    *data = get_le(h + 24, 8);
    if (body > MAX_BODY + 65536 || !body_room(c, body + 1)) return CW_PROTO;
    if (rd(c, c->body, body)) return CW_IO;
    c->body[body] = 0; /* error messages are text */
    c->body_len = body;
    return 0;
}

int cw_recv_reply(cw_conn *c, uint64_t rid, int method, void *out, size_t out_bytes) {
    int type, m;
    uint64_t got_rid, data;
    uint32_t status;
    int rc = read_head(c, &type, &m, &got_rid, &status, &data);
    if (rc) return c->status = rc;
    if (type != REPLY || got_rid != rid) {
        if (status) cw_log("%s: the worker ended the connection: %s", cw_method_name(method),
                           (const char *)c->body);
        return c->status = CW_PROTO;
    }
    if (status) {
        cw_log("%s: %s", cw_method_name(method), (const char *)c->body);
        if (discard(c, data)) return c->status = CW_IO;
        return c->status = (int)status;
    }
    if (!out) return c->status = discard(c, data) ? CW_IO : 0;
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f;
    pb_arr a;
    int found = 0;
    while (pb_next(&r, &f))
        if (f.field == 1 && f.wt == 2) found = pb_read_array(f.ptr, f.len, &a);
    uint64_t have = found ? (a.staged ? a.len : a.data_len) : 0;
    if (!found || a.dtype != 1 || have != out_bytes || (a.staged && a.off + a.len > data)) {
        cw_log("%s: expected a float32 result of %zu bytes, got %llu", cw_method_name(method),
               out_bytes, (unsigned long long)have);
        discard(c, data);
        return c->status = CW_PROTO;
    }
    if (!a.staged) {
        memcpy(out, a.data, out_bytes);
        return c->status = discard(c, data) ? CW_IO : 0;
    }
    if (discard(c, a.off) || rd(c, out, out_bytes) || discard(c, data - a.off - a.len))
        return c->status = CW_IO;
    return c->status = 0;
}

int cw_exchange(cw_conn *c, int method, void *out, size_t out_bytes) {
    uint64_t rid = cw_send_call(c, method);
    if (!rid) return c->status;
    return cw_recv_reply(c, rid, method, out, out_bytes);
}

/* -- connecting ----------------------------------------------------------------------- */

static int dial_tcp(const char *host, int port) {
    struct addrinfo hints, *res = NULL, *ai;
    char ports[16];
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(ports, sizeof ports, "%d", port);
    if (getaddrinfo(host, ports, &hints, &res)) return -1;
    int fd = -1;
    int ms = cw_cfg.timeout_ms < CONNECT_TIMEOUT_MS ? cw_cfg.timeout_ms : CONNECT_TIMEOUT_MS;
    for (ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                    ai->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
        int err = 0;
        socklen_t len = sizeof err;
        if (errno != EINPROGRESS || wait_io(fd, POLLOUT, ms) ||
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) || err) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

static int dial_unix(const char *path) {
    struct sockaddr_un a;
    if (strlen(path) >= sizeof a.sun_path) return -1;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    strcpy(a.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { close(fd); return -1; }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

#ifdef COLIWORKER_WITH_TLS
static int tls_handshake(cw_conn *c, const char *host, int quiet) {
    SSL *s = SSL_new(cw_ssl_ctx);
    if (!s) return 0;
    c->ssl = s;
    SSL_set_fd(s, c->fd);
    unsigned char ip[16];
    if (inet_pton(AF_INET, host, ip) == 1 || inet_pton(AF_INET6, host, ip) == 1) {
        X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(s), host);
    } else {
        SSL_set_tlsext_host_name(s, host);
        SSL_set1_host(s, host);
    }
    SSL_set_verify(s, SSL_VERIFY_PEER, NULL);
    for (;;) {
        int k = SSL_connect(s);
        if (k == 1) return 1;
        int e = SSL_get_error(s, k);
        if (e == SSL_ERROR_WANT_READ && !wait_io(c->fd, POLLIN, cw_cfg.timeout_ms)) continue;
        if (e == SSL_ERROR_WANT_WRITE && !wait_io(c->fd, POLLOUT, cw_cfg.timeout_ms)) continue;
        if (!quiet) {
            char msg[256];
            ERR_error_string_n(ERR_get_error(), msg, sizeof msg);
            cw_log("%s:%d: TLS handshake failed: %s", host, c->w->port, msg);
        }
        return 0;
    }
}
#endif

cw_conn *cw_connect(cw_worker *w, int quiet) {
    cw_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->w = w;
    c->fd = w->is_unix ? dial_unix(w->host) : dial_tcp(w->host, w->port);
    if (c->fd < 0) {
        if (!quiet) cw_log("cannot connect to %s: %s", w->address, strerror(errno));
        free(c);
        return NULL;
    }
    if (cw_cfg.tls && !w->is_unix) {
#ifdef COLIWORKER_WITH_TLS
        if (!tls_handshake(c, w->host, quiet)) goto fail;
#else
        goto fail;
#endif
    }
    cw_begin(c);
    pb_uint(&c->req, 1, 1); /* DataHello.version */
    if (cw_cfg.token[0]) pb_bytes(&c->req, 2, cw_cfg.token, strlen(cw_cfg.token));
    if (send_frame(c, HELLO, 0, 0)) goto fail;
    int type, m;
    uint64_t rid, data;
    uint32_t status;
    int rc = read_head(c, &type, &m, &rid, &status, &data);
    if (rc || type != WELCOME) {
        if (!quiet)
            cw_log("%s: no WELCOME from the data plane (is this the data port? it is the "
                   "gRPC port + 1 by default)", w->address);
        goto fail;
    }
    if (status) {
        if (!quiet) cw_log("%s: refused: %s", w->address, (const char *)c->body);
        goto fail;
    }
    pb_rd r = {c->body, c->body + c->body_len, 0};
    pb_field f;
    while (pb_next(&r, &f)) {
        if (f.field == 2 && f.wt == 2 && f.len < sizeof c->instance) {
            memcpy(c->instance, f.ptr, f.len);
            c->instance[f.len] = 0;
        } else if (f.field == 3 && f.wt == 0) {
            c->max_frame = f.v;
        }
    }
    return c;
fail:
    cw_close(c);
    return NULL;
}

/* Whether a connection that sat in the pool is still open: a worker closes idle ones after
 * --data-idle-timeout. An idle plain connection has nothing to read, so end of stream or any
 * byte means the worker is done with it; over TLS pending bytes can be the worker's session
 * tickets, so only the end of stream counts there. */
int cw_alive(cw_conn *c) {
    char b;
    ssize_t k = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0) return 0;
    if (k < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    return c->ssl != NULL;
}

void cw_close(cw_conn *c) {
    if (!c) return;
#ifdef COLIWORKER_WITH_TLS
    if (c->ssl) SSL_free(c->ssl);
#endif
    if (c->fd >= 0) close(c->fd);
    free(c->body);
    free(c->iov);
    pb_release(&c->req);
    free(c);
}
