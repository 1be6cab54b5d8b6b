// Thread-block cluster primitives of the kernels whose blocks meet in distributed shared memory
// (gemv_tc_splitk.cuh's gemv_tc_sk, prefill_tc.cu's gemv_pf_sk, attention_flash.cuh's
// mla_flash_c and mla_flash_hc): a block's rank in its cluster, the cluster barriers, and loads
// from another block's shared memory (DSMEM). Inline PTX (mapa, ld.shared::cluster,
// barrier.cluster): the instructions cooperative_groups' cluster.map_shared_rank and
// cluster.sync compile to, without its headers (NVRTC as CuPy calls it needs no include path
// for them).
#pragma once

__device__ __forceinline__ unsigned int coli_cluster_rank() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// All threads of all blocks of the cluster; shared-memory writes before it are visible to the
// cluster's reads after it.
__device__ __forceinline__ void coli_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The last barrier of a cluster: no ordering of memory is needed (a block's reads of another's
// shared memory have returned before it arrives), only that none leaves early.
__device__ __forceinline__ void coli_cluster_wait_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\t"
                 "barrier.cluster.wait.aligned;" ::: "memory");
}

// The address of p (this block's shared memory) in block `rank` of this cluster.
__device__ __forceinline__ unsigned coli_remote(const void *p, unsigned rank) {
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

// p[0] in the shared memory of block `rank` of this cluster (p: this block's copy).
__device__ __forceinline__ float coli_dsmem_load(const float *p, unsigned rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(coli_remote(p, rank))
                 : "memory");
    return v;
}

// p[0 .. 3] (16-byte aligned) in the shared memory of block `rank` of this cluster.
__device__ __forceinline__ float4 coli_dsmem_load4(const float *p, unsigned rank) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(coli_remote(p, rank))
                 : "memory");
    return v;
}

// The end of a split-K GEMV block of a cluster of C (gemv_tc_sk, gemv_pf_sk): part[s * ROWS + rr]
// holds this block's sum of output (activation row srow0 + s, weight row row0 + rr), s < NS,
// over its share of K. After a cluster barrier rank r writes outputs o = r, r + C, ...: the C
// blocks' sums in rank order 0 .. C - 1, times the row's scale where SCALE (fmt 2). All
// threads of all C blocks call it.
template <int ROWS, int NS, int C, bool SCALE>
__device__ __forceinline__ void coli_split_k_out(const float *part, float *__restrict__ y,
                                                 int y_stride, int rows, int srow0,
                                                 int out_rows, int row0, const float *sc,
                                                 int rank) {
    coli_cluster_sync();  // every block's sums are written
    for (int o = rank + C * threadIdx.x; o < ROWS * NS; o += C * blockDim.x) {
        const int s = o / ROWS, rr = o - s * ROWS;
        const int row = row0 + rr, srow = srow0 + s;
        if (row >= out_rows || srow >= rows) continue;
        float v[C];
#pragma unroll
        for (int k = 0; k < C; ++k) v[k] = coli_dsmem_load(part + o, k);
        float sum = v[0];
#pragma unroll
        for (int k = 1; k < C; ++k) sum += v[k];
        y[(size_t)srow * y_stride + row] = SCALE ? sum * sc[row] : sum;
    }
    coli_cluster_wait_exit();  // no block leaves while another reads its shared memory
}
