/* Internals of libcoliworker_cuda.so shared by its source files (not installed).
 *
 *   coliworker_cuda.h   the seed's ABI (the only public header)
 *   sha256.c            content hashes of uploads (SHA-256, no OpenSSL)
 *   pb.c                the proto3 subset the data plane's messages need
 *   conn.c              one data-plane connection: socket / TLS, frames, HELLO
 *   workers.c           configuration, init, connection pools, reconnects
 *   devices.c           Info, device count / ids / memory, stats
 *   tensors.c           upload / update / free, host copies (COLIWORKER_RETAIN)
 *   compute.c           matmul, expert MLP / group / issue / take, attention
 *   ragged.c            ragged attention: engine keys -> worker sequence ids
 *   nodevice.c          the device-pointer family: not offered (0 / NULL)
 */
#ifndef COLIWORKER_CW_H
#define COLIWORKER_CW_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "coliworker_cuda.h"

/* Method numbers (enum Method in proto/coliworker/v1/worker.proto). */
enum {
    M_INFO = 1, M_LOOKUP = 2, M_UPLOAD = 3, M_UPDATE = 4, M_FREE = 5, M_STATS = 6,
    M_MATMUL = 7, M_EXPERT_MLP = 8, M_EXPERT_GROUP = 9, M_ATTENTION = 13,
    M_ATTENTION_RAGGED = 14, M_FREE_SEQUENCE = 15
};

/* Results of one exchange: 0 OK, > 0 the worker's gRPC status (the connection is fine),
 * CW_IO the connection is broken (closed, reset, timed out), CW_PROTO a reply that does
 * not fit the call (the connection is dropped too). */
#define CW_IO (-1)
#define CW_PROTO (-2)
#define CW_ALIGN 64
#define CW_MAX_WORKERS COLI_CUDA_MAX_DEVICES

/* -- sha256.c ------------------------------------------------------------------------ */
typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t buf[64];
    size_t fill;
} cw_sha256;
void cw_sha256_init(cw_sha256 *s);
void cw_sha256_update(cw_sha256 *s, const void *data, size_t n);
void cw_sha256_final(cw_sha256 *s, uint8_t out[32]);
void cw_content_hash(int fmt, int I, int O, int gs, const void *w, size_t wbytes,
                     const void *s, size_t sbytes, uint8_t out[32]);

/* -- pb.c ---------------------------------------------------------------------------- */
typedef struct {
    uint8_t *p;
    size_t n, cap;
    int oom; /* an allocation failed: the message is unusable */
} pb_buf;
void pb_reset(pb_buf *b);
void pb_release(pb_buf *b);
void pb_varint(pb_buf *b, uint64_t v);
void pb_uint(pb_buf *b, int field, uint64_t v);   /* varint field (uint*, bool, enum) */
void pb_int(pb_buf *b, int field, int64_t v);     /* int32 / int64 (sign-extended) */
void pb_bytes(pb_buf *b, int field, const void *p, size_t n);
void pb_float(pb_buf *b, int field, float v);
size_t pb_open(pb_buf *b, int field);             /* a nested message or packed field */
void pb_close(pb_buf *b, size_t start);
/* An Array {dtype FLOAT32, shape, staged {offset, length}}. */
void pb_array(pb_buf *b, int field, const int64_t *shape, int nd, uint64_t off,
              uint64_t len);

typedef struct {
    const uint8_t *p, *end;
    int bad;
} pb_rd;
typedef struct {
    int field, wt;
    uint64_t v;          /* varint / fixed value */
    const uint8_t *ptr;  /* length-delimited: contents */
    size_t len;
} pb_field;
int pb_next(pb_rd *r, pb_field *f); /* 1: a field; 0: end (r->bad set on malformed) */
/* A decoded Array: its bytes inline (data) or a staged slice of the frame's data. */
typedef struct {
    int dtype, nd, staged, has_data;
    int64_t shape[8];
    uint64_t off, len;         /* staged slice of the frame data */
    const uint8_t *data;       /* inline bytes */
    size_t data_len;
} pb_arr;
int pb_read_array(const uint8_t *p, size_t n, pb_arr *a); /* 1 ok */

/* -- conn.c -------------------------------------------------------------------------- */
struct cw_worker;
typedef struct cw_conn {
    int fd;
    void *ssl;
    struct cw_worker *w;
    uint64_t rid;
    char instance[80];
    uint64_t max_frame;
    uint8_t *body; size_t body_len, body_cap;   /* the last reply's body */
    pb_buf req;                                  /* a request body, reused */
    struct iovec *iov; int niov, iov_cap;       /* a frame's data pieces */
    uint64_t data_off;                           /* bytes of data placed so far */
    int status;                                  /* the last reply's status */
    struct cw_conn *next;
} cw_conn;

cw_conn *cw_connect(struct cw_worker *w, int quiet);
void cw_close(cw_conn *c);
int cw_alive(cw_conn *c); /* a pooled connection not closed by the worker meanwhile */
/* Frame data: cw_begin clears it; cw_place appends a piece at the next 64-byte aligned
 * offset and returns that offset; cw_append appends without padding (uploads). */
void cw_begin(cw_conn *c);
uint64_t cw_place(cw_conn *c, const void *p, size_t n);
int cw_append(cw_conn *c, const void *p, size_t n);
/* Send c->req as the body of a CALL with the placed data; returns the request id or 0. */
uint64_t cw_send_call(cw_conn *c, int method);
/* Read the REPLY to `rid`: body into c->body; the result Array (field 1 of the reply)
 * into out (out_bytes exactly, float32), or the data dropped when out is NULL. */
int cw_recv_reply(cw_conn *c, uint64_t rid, int method, void *out, size_t out_bytes);
int cw_exchange(cw_conn *c, int method, void *out, size_t out_bytes);
const char *cw_method_name(int method);

/* -- workers.c ----------------------------------------------------------------------- */
typedef struct cw_worker {
    int index;
    char address[256];   /* as configured */
    int is_unix;
    char host[256];      /* host name / IP, or the socket path */
    int port;
    int ndev;
    int rdev[COLI_CUDA_MAX_DEVICES];  /* the worker's device ids, Info order */
    int first;                        /* engine id of rdev[0] */
    pthread_mutex_t mu;               /* idle, up, instance, reconnecting */
    cw_conn *idle;
    int nidle;
    int up;
    uint64_t epoch;                   /* handles and sequences are valid in this epoch */
    char instance[80];
    int reconnecting;
    uint32_t max_experts, max_seqs;
    uint64_t max_frame;
    pthread_mutex_t reg_mu;           /* tensors (host copies), deferred frees */
    ColiCudaTensor *tensors;
    uint64_t *dfree; size_t ndfree, capdfree; uint64_t dfree_epoch;
    uint64_t gbase[6], glast[6];      /* group totals: before restarts, last read */
} cw_worker;

typedef struct {
    char token[1024];
    char tls_ca[1024], tls_cert[1024], tls_key[1024];
    int tls;
    int timeout_ms;
    int spin_us;
    int retain;
    int seq_idle_calls; /* ragged sequences unused this many calls on their kv_b are freed */
    int seq_max;        /* and at most this many per kv_b (least recently used go first) */
} cw_config;

typedef struct cw_pend {
    cw_conn *c;
    uint64_t rid;
    float *buf;
    size_t bytes;
    struct cw_pend *next;
} cw_pend;

typedef struct {
    int id;              /* the engine's device id */
    cw_worker *w;
    int rdev;            /* the worker's device id */
    pthread_mutex_t mu;  /* issue / take */
    cw_pend *head, *tail;
    int npend;
    float **taken; int ntaken, captaken; /* results handed out since the last issue */
} cw_dev;

extern cw_config cw_cfg;
extern int cw_nworkers;
extern cw_worker cw_workers[CW_MAX_WORKERS];
extern int cw_ndev;
extern cw_dev cw_devs[COLI_CUDA_MAX_DEVICES];
extern int cw_inited;

cw_dev *cw_find_dev(int device);
cw_conn *cw_acquire(cw_worker *w);
/* Give a connection back after an exchange that ended with `code`: kept when it is still
 * in step (code >= 0), closed otherwise (CW_IO also starts a reconnect). Returns 1 when
 * code is 0. */
int cw_release(cw_conn *c, int code);
void cw_mark_down(cw_worker *w);
uint64_t cw_epoch_now(const cw_worker *w);
uint64_t cw_new_epoch(void);
void cw_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* -- devices.c ----------------------------------------------------------------------- */
typedef struct {
    int id;
    uint64_t total, free, limit;
} cw_dev_info;
/* Info over c: the worker's devices (Info order) into devs, and its limits into w (when
 * not NULL). */
int cw_info(cw_conn *c, cw_worker *w, cw_dev_info *devs, int *ndev);

/* -- tensors.c ----------------------------------------------------------------------- */
struct cw_seqtab;
struct ColiCudaTensor {
    int fmt, I, O, gs, device;
    cw_worker *w;
    int rdev;
    uint64_t handle;     /* valid while epoch == w->epoch (atomic accesses) */
    uint64_t epoch;
    size_t wbytes, sbytes;
    uint8_t hash[32];
    uint8_t *host;       /* COLIWORKER_RETAIN: weights || scales */
    pthread_mutex_t mu;  /* the ragged sequence table */
    struct cw_seqtab *seqs;
    ColiCudaTensor *prev, *next; /* w->tensors */
};
size_t cw_row_bytes(int fmt, int I);
size_t cw_scale_count(int fmt, int I, int O, int gs);
/* The tensor's handle when it is live in its worker's current epoch, else 0. */
uint64_t cw_handle(const ColiCudaTensor *t);
/* Put weights||scales of t on the worker through c (hash lookup first); 0 OK. */
int cw_put(cw_conn *c, ColiCudaTensor *t, const void *w, const void *s, uint64_t *handle);
void cw_free_handle(cw_worker *w, uint64_t handle, uint64_t epoch);

/* -- compute.c / ragged.c ------------------------------------------------------------ */
int cw_fault_injected(void);
void cw_seqtab_free(struct cw_seqtab *t);
void cw_devq_drain(cw_dev *d);

#endif
