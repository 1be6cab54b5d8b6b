// Thread-block cluster primitives of the split-K kernels (gemv_tc_splitk.cuh's gemv_tc_sk,
// prefill_tc.cu's gemv_pf_sk): a block's rank in its cluster, the cluster barriers, and a load
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

// p[0] in the shared memory of block `rank` of this cluster (p: this block's copy).
__device__ __forceinline__ float coli_dsmem_load(const float *p, unsigned int rank) {
    unsigned int local, remote;
    float v;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(local) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
