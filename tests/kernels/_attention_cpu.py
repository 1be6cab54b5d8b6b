"""Shared by the tests that run attention.cu's kernels on the CPU under fibers.h
(test_attention_cpu.py: the absorb's q split; test_attention_flash_cpu.py: the flash and merge
kernels): one fiber (ucontext) per CUDA thread, run in turn until each reaches a barrier
(__syncthreads, a warp's, the cluster's); the kernels' inline-PTX helpers cut
(``cpu_source``) and modelled instead (attention_models.h: the tf32 and f16 mma, cp.async,
the fp16 split, ldmatrix; cluster_models.h: DSMEM reads by the same offset in the rank's
block, the cluster barrier). ``FIBER_SHIM`` is the head of such a test's shim: the models, then
the kernels as kernel.inc; the test's checks follow it."""

from __future__ import annotations

from _emulate import without_ptx

FIBER_SHIM = r"""
#include "fibers.h"
#include "attention_models.h"
#include "cluster_models.h"
#include "common.cuh"
#include "kernel.inc"
"""
FL_ASM = (
    "fl_mma", "fl_cp4", "fl_cp16", "coli_cluster_rank", "coli_cluster_sync",
    "coli_cluster_wait_exit", "coli_remote", "coli_dsmem_load", "coli_dsmem_load4", "fh_split2",
    "fh_mma", "fh_ldsm4", "fh_ldsm4t", "fh_ldsm2t",
)  # fmt: skip


def cpu_source(src: str) -> str:
    """attention.cu's kernels (attention_flash.cuh and attention_flash_h.cuh inlined, as
    compiled; common.cuh left to the shim) without their inline PTX, their shared memory the
    fiber's block memory."""
    part = without_ptx(src[src.index("struct KvDesc") :], FL_ASM)
    for old, new in (
        ("extern __shared__ float wz[];", "float *wz = (float *)cur_smem();"),
        ("extern __shared__ float qs[];", "float *qs = (float *)cur_smem();"),
        ("extern __shared__ float4 abw_sm4[];", "float4 *abw_sm4 = cur_smem();"),
        (
            "__shared__ float red[2][4];",
            "float (&red)[2][4] = *(float (*)[2][4])((float *)cur_smem() + 60000);",
        ),
    ):
        assert old in part, old
        part = part.replace(old, new)
    return part
