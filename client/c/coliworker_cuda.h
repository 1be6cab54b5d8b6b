/* coliworker_cuda.h: the seed's in-process CUDA backend ABI (coli_cuda_*), served by a
 * remote coliworker over its socket data plane (proto/FRAMES.md).
 *
 * A C engine that loads the seed's backend library loads libcoliworker_cuda.so instead
 * (scripts/build-c builds it into build/); the signatures below are the seed's, unchanged.
 * Every int entry point returns 1 on success and 0 for "fall back to the CPU"; nothing
 * aborts. ColiCudaTensor is opaque. Configuration is read from the environment at
 * coli_cuda_init (docs/c-client.md): COLIWORKER_ADDRESS (the data plane, host:port or
 * unix:/path, several comma-separated), COLIWORKER_TOKEN / COLIWORKER_TOKEN_FILE,
 * COLIWORKER_TLS_CA / _CERT / _KEY, COLIWORKER_TIMEOUT_MS, COLIWORKER_RETAIN.
 *
 * Device ids are the engine's: they index the devices of all listed workers in order
 * (worker 0's devices first). Thread-safe: any entry point may be called from any thread.
 *
 * NOT OFFERED: the device-pointer family (coli_cuda_pipe_*, *_dev, *_dev_out, *_kvdev)
 * needs memory in the engine's address space on the GPU, which a remote worker cannot
 * give. Those functions exist so the library links in place of the seed's, and return
 * 0 / NULL (or do nothing) so the engine takes its CPU path.
 */
#ifndef COLIWORKER_CUDA_H
#define COLIWORKER_CUDA_H

#include <stddef.h>
#include <stdint.h>

#define COLI_CUDA_MAX_DEVICES 16

typedef struct ColiCudaTensor ColiCudaTensor;

#ifdef __cplusplus
extern "C" {
#endif

/* -- lifecycle and queries ------------------------------------------------------------ */
int coli_cuda_init(const int *devices, int count);
void coli_cuda_shutdown(void);
int coli_cuda_device_count(void);
int coli_cuda_device_at(int index);
int coli_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes);
void coli_cuda_stats(int device, size_t *tensor_count, size_t *tensor_bytes);
void coli_cuda_group_stats(uint64_t *calls, uint64_t *experts, uint64_t *rows,
                           double *h2d_ms, double *kernel_ms, double *d2h_ms);

/* -- resident tensors ----------------------------------------------------------------- */
int coli_cuda_tensor_upload(ColiCudaTensor **tensor, const void *weights, const float *scales,
                            int fmt, int I, int O, int device);
int coli_cuda_tensor_upload_g(ColiCudaTensor **tensor, const void *weights,
                              const float *scales, int fmt, int I, int O, int device, int gs);
int coli_cuda_tensor_update(ColiCudaTensor *tensor, const void *weights, const float *scales);
void coli_cuda_tensor_free(ColiCudaTensor *tensor);
size_t coli_cuda_tensor_bytes(const ColiCudaTensor *tensor);
int coli_cuda_tensor_device(const ColiCudaTensor *tensor);

/* -- compute (host pointers) ---------------------------------------------------------- */
int coli_cuda_matmul(ColiCudaTensor **tensor, float *y, const float *x, const void *weights,
                     const float *scales, int fmt, int S, int I, int O, int device);
int coli_cuda_expert_mlp(ColiCudaTensor *gate, ColiCudaTensor *up, ColiCudaTensor *down,
                         float *y, const float *x, int S);
int coli_cuda_shared_mlp_w4a16(ColiCudaTensor *gate, ColiCudaTensor *up, ColiCudaTensor *down,
                               float *y, const float *x, int S);
int coli_cuda_expert_group(ColiCudaTensor *const *gates, ColiCudaTensor *const *ups,
                           ColiCudaTensor *const *downs, const int *rows, int count, float *y,
                           const float *x);
int coli_cuda_expert_group_issue(ColiCudaTensor *const *gates, ColiCudaTensor *const *ups,
                                 ColiCudaTensor *const *downs, const int *rows, int count,
                                 const float *x);
const float *coli_cuda_expert_group_take(int device);
int coli_cuda_attention_absorb(ColiCudaTensor *w, float *ctx, const float *q,
                               const float *latent, const float *rope, int H, int Q, int R,
                               int V, int K, int T, float scale);
int coli_cuda_attention_absorb_batch(ColiCudaTensor *w, float *ctx, const float *q,
                                     const float *latent, const float *rope, int S, int H,
                                     int Q, int R, int V, int K, int T, float scale);
int coli_cuda_attention_project_batch(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                      const float *q, const float *latent, const float *rope,
                                      int S, int H, int Q, int R, int V, int K, int T,
                                      float scale);
int coli_cuda_attention_project_ragged(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                       const float *q, const void *const *keys,
                                       const float *const *latent, const float *const *rope,
                                       const int *lengths, int S, int H, int Q, int R, int V,
                                       int K, int T, float scale);

/* -- device-pointer family: NOT OFFERED, always 0 / NULL (the engine falls back) ------ */
float *coli_cuda_pipe_scratch(int device, int slot, size_t bytes);
void *coli_cuda_pipe_alloc(int device, size_t bytes);
void coli_cuda_pipe_free(int device, void *p);
int coli_cuda_pipe_upload(int device, void *dst, const void *src, size_t bytes);
int coli_cuda_pipe_download(int device, const void *src, void *dst, size_t bytes);
int coli_cuda_pipe_rmsnorm(int device, float *y_dev, const float *x_dev, const float *w_dev,
                           int S, int D, float eps);
int coli_cuda_pipe_rmsnorm_s(int device, float *y_dev, const float *x_dev, const float *w_dev,
                             int S, int D, float eps, int xstride, int ystride);
int coli_cuda_pipe_rope(int device, float *v_dev, const int *pos_dev, int rows, int stride,
                        int offset, int R, int heads, float theta);
int coli_cuda_pipe_rope_base(int device, float *v_dev, int pos_base, int rows, int stride,
                             int offset, int R, int heads, float theta);
int coli_cuda_pipe_router(int device, const float *x_dev, const void *rw_dev,
                          const void *rb_dev, int D, int E, int Ksel, float topp,
                          int norm_topk, float routed_scale, int *idx_host, float *w_host,
                          int *keff_host);
int coli_cuda_pipe_copy2d(int device, float *dst, int dpitch, const float *src, int spitch,
                          int width, int height);
int coli_cuda_attention_project_batch_dev(ColiCudaTensor *w, ColiCudaTensor *proj, float *out,
                                          const float *q_dev, const float *latent_dev,
                                          const float *rope_dev, int S, int H, int Q, int R,
                                          int V, int K, int T, float scale);
int coli_cuda_pipe_silu_mul(int device, float *gate_dev, const float *up_dev, size_t n);
int coli_cuda_pipe_add(int device, float *x_dev, const float *t_dev, size_t n);
int coli_cuda_pipe_rows_add(int device, float *x_dev, const float *partial_dev,
                            const int *rows_dev, int nrows, int D);
int coli_cuda_pipe_gemm(ColiCudaTensor *t, float *y_dev, const float *x_dev, int S);
int coli_cuda_pipe_peer_copy(int dst_dev, float *dst, int src_dev, const float *src,
                             size_t bytes);
int coli_cuda_attention_project_batch_dev_out(ColiCudaTensor *w, ColiCudaTensor *proj,
                                              float *out_dev, const float *q_dev,
                                              const float *latent_dev, const float *rope_dev,
                                              int S, int H, int Q, int R, int V, int K, int T,
                                              float scale);
int coli_cuda_attention_absorb_batch_dev(ColiCudaTensor *w, float *ctx_dev, const float *q_dev,
                                         const float *latent_dev, const float *rope_dev, int S,
                                         int H, int Q, int R, int V, int K, int T, float scale);
int coli_cuda_attention_absorb_kvdev(ColiCudaTensor *w, float *ctx, const float *q,
                                     const float *latent_dev, const float *rope_dev, int H,
                                     int Q, int R, int V, int K, int T, float scale);
int coli_cuda_pipe_sync(int device);

#ifdef __cplusplus
}
#endif
#endif /* COLIWORKER_CUDA_H */
