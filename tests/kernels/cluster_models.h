// Models of cluster.cuh's inline PTX for the tests that run a cluster kernel's source on the CPU
// (test_attention_cpu.py, test_attention_flash_cpu.py, test_prefill_tc_cpu.py): clusters of
// g_cluster blocks along x, which fibers.h launches together; the cluster barrier; loads from
// another block's shared memory at the same offset as p in this block's.
#pragma once
#include "fibers.h"
int g_cluster = 1;
inline unsigned coli_cluster_rank() { return (unsigned)(blockIdx.x % g_cluster); }
inline void coli_cluster_sync() { g_cbar->arrive_and_wait(); }
inline void coli_cluster_wait_exit() { g_cbar->arrive_and_wait(); }
inline float coli_dsmem_load(const float *p, unsigned rank) {
    const ptrdiff_t off = p - (const float *)tl_blk->smem;
    return ((const float *)g_blocks[rank].smem)[off];
}
inline float4 coli_dsmem_load4(const float *p, unsigned rank) {
    const ptrdiff_t off = p - (const float *)tl_blk->smem;
    float4 v;
    std::memcpy(&v, (const float *)g_blocks[rank].smem + off, 16);
    return v;
}
