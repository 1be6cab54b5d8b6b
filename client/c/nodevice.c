/* The seed's device-pointer family. Its pointers are device memory in the engine's own
 * process, which a worker on another host cannot provide, so none of it is offered: every
 * function reports failure (0 / NULL, or nothing to do) and the engine takes its CPU path.
 * Those the seed counts against COLI_GPU_FAIL_AFTER count here too, so an engine test
 * that sets it sees the same numbering of compute calls. */
#include "cw.h"

#define UNUSED(x) (void)(x)

float *coli_cuda_pipe_scratch(int device, int slot, size_t bytes) {
    UNUSED(device); UNUSED(slot); UNUSED(bytes);
    return NULL;
}

void *coli_cuda_pipe_alloc(int device, size_t bytes) {
    UNUSED(device); UNUSED(bytes);
    return NULL;
}

void coli_cuda_pipe_free(int device, void *p) { UNUSED(device); UNUSED(p); }

int coli_cuda_pipe_upload(int device, void *dst, const void *src, size_t bytes) {
    UNUSED(device); UNUSED(dst); UNUSED(src); UNUSED(bytes);
    return 0;
}

int coli_cuda_pipe_download(int device, const void *src, void *dst, size_t bytes) {
    UNUSED(device); UNUSED(src); UNUSED(dst); UNUSED(bytes);
    return 0;
}

int coli_cuda_pipe_rmsnorm(int device, float *y_dev, const float *x_dev, const float *w_dev,
                           int S, int D, float eps) {
    UNUSED(device); UNUSED(y_dev); UNUSED(x_dev); UNUSED(w_dev); UNUSED(S); UNUSED(D);
    UNUSED(eps);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_rmsnorm_s(int device, float *y_dev, const float *x_dev, const float *w_dev,
                             int S, int D, float eps, int xstride, int ystride) {
    UNUSED(device); UNUSED(y_dev); UNUSED(x_dev); UNUSED(w_dev); UNUSED(S); UNUSED(D);
    UNUSED(eps); UNUSED(xstride); UNUSED(ystride);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_rope(int device, float *v_dev, const int *pos_dev, int rows, int stride,
                        int offset, int R, int heads, float theta) {
    UNUSED(device); UNUSED(v_dev); UNUSED(pos_dev); UNUSED(rows); UNUSED(stride);
    UNUSED(offset); UNUSED(R); UNUSED(heads); UNUSED(theta);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_rope_base(int device, float *v_dev, int pos_base, int rows, int stride,
                             int offset, int R, int heads, float theta) {
    UNUSED(device); UNUSED(v_dev); UNUSED(pos_base); UNUSED(rows); UNUSED(stride);
    UNUSED(offset); UNUSED(R); UNUSED(heads); UNUSED(theta);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_router(int device, const float *x_dev, const void *rw_dev,
                          const void *rb_dev, int D, int E, int Ksel, float topp,
                          int norm_topk, float routed_scale, int *idx_host, float *w_host,
                          int *keff_host) {
    UNUSED(device); UNUSED(x_dev); UNUSED(rw_dev); UNUSED(rb_dev); UNUSED(D); UNUSED(E);
    UNUSED(Ksel); UNUSED(topp); UNUSED(norm_topk); UNUSED(routed_scale); UNUSED(idx_host);
    UNUSED(w_host); UNUSED(keff_host);
    return 0;
}

int coli_cuda_pipe_copy2d(int device, float *dst, int dpitch, const float *src, int spitch,
                          int width, int height) {
    UNUSED(device); UNUSED(dst); UNUSED(dpitch); UNUSED(src); UNUSED(spitch);
    UNUSED(width); UNUSED(height);
    return 0;
}

int coli_cuda_attention_project_batch_dev(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                          const float *q_dev, const float *latent_dev,
                                          const float *rope_dev, int S, int H, int Q, int R,
                                          int V, int K, int T, float scale) {
    UNUSED(w); UNUSED(proj); UNUSED(out); UNUSED(q_dev); UNUSED(latent_dev);
    UNUSED(rope_dev); UNUSED(S); UNUSED(H); UNUSED(Q); UNUSED(R); UNUSED(V); UNUSED(K);
    UNUSED(T); UNUSED(scale);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_silu_mul(int device, float *gate_dev, const float *up_dev, size_t n) {
    UNUSED(device); UNUSED(gate_dev); UNUSED(up_dev); UNUSED(n);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_add(int device, float *x_dev, const float *t_dev, size_t n) {
    UNUSED(device); UNUSED(x_dev); UNUSED(t_dev); UNUSED(n);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_rows_add(int device, float *x_dev, const float *partial_dev,
                            const int *rows_dev, int nrows, int D) {
    UNUSED(device); UNUSED(x_dev); UNUSED(partial_dev); UNUSED(rows_dev); UNUSED(nrows);
    UNUSED(D);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_gemm(ColiCudaTensor *t, float *y_dev, const float *x_dev, int S) {
    UNUSED(t); UNUSED(y_dev); UNUSED(x_dev); UNUSED(S);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_peer_copy(int dst_dev, float *dst, int src_dev, const float *src,
                             size_t bytes) {
    UNUSED(dst_dev); UNUSED(dst); UNUSED(src_dev); UNUSED(src); UNUSED(bytes);
    return 0;
}

int coli_cuda_attention_project_batch_dev_out(ColiCudaTensor *w, ColiCudaTensor *proj,
                                              float *out_dev, const float *q_dev,
                                              const float *latent_dev, const float *rope_dev,
                                              int S, int H, int Q, int R, int V, int K, int T,
                                              float scale) {
    UNUSED(w); UNUSED(proj); UNUSED(out_dev); UNUSED(q_dev); UNUSED(latent_dev);
    UNUSED(rope_dev); UNUSED(S); UNUSED(H); UNUSED(Q); UNUSED(R); UNUSED(V); UNUSED(K);
    UNUSED(T); UNUSED(scale);
    cw_fault_injected();
    return 0;
}

int coli_cuda_attention_absorb_batch_dev(ColiCudaTensor *w, float *ctx_dev, const float *q_dev,
                                         const float *latent_dev, const float *rope_dev, int S,
                                         int H, int Q, int R, int V, int K, int T, float scale) {
    UNUSED(w); UNUSED(ctx_dev); UNUSED(q_dev); UNUSED(latent_dev); UNUSED(rope_dev);
    UNUSED(S); UNUSED(H); UNUSED(Q); UNUSED(R); UNUSED(V); UNUSED(K); UNUSED(T);
    UNUSED(scale);
    cw_fault_injected();
    return 0;
}

int coli_cuda_attention_absorb_kvdev(ColiCudaTensor *w, float *ctx, const float *q,
                                     const float *latent_dev, const float *rope_dev, int H,
                                     int Q, int R, int V, int K, int T, float scale) {
    UNUSED(w); UNUSED(ctx); UNUSED(q); UNUSED(latent_dev); UNUSED(rope_dev); UNUSED(H);
    UNUSED(Q); UNUSED(R); UNUSED(V); UNUSED(K); UNUSED(T); UNUSED(scale);
    cw_fault_injected();
    return 0;
}

int coli_cuda_pipe_sync(int device) {
    UNUSED(device);
    return 0;
}
