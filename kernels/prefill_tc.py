"""gemv_pf's and moe_pf's host side (kernel: ``kernels/prefill_tc.cu``; the int4 products of
more than ``matmul.TC_MAX_ROWS`` activation rows on tensor cores): the tile constants, the
split-K switches (``PF_SPLIT_K``, set from the environment at import, and ``PF_SK_FORCE``), a
many-row gemv's (KS, C) choice (``_pf_choice``) and the two launches: ``_gemv_pf``, taken by
``matmul.gemv_launch``, and ``_moe_pf``, by ``matmul.moe_launch``. Where the path serves is
``matmul.prefill_eligible`` (beside ``tc_eligible``: both read ``matmul.TENSOR_CORES``). Tests:
``tests/kernels/test_prefill_tc.py`` (on a GPU; the choice), ``test_prefill_tc_cpu.py`` (the
source on the CPU).

``kernels/matmul.py`` imports this module (its ``settings()`` reads the switches here); what
this module uses of matmul (``WARPS``, ``_resident_blocks``) it imports in the functions that
use it, when called: no import cycle at load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.launch import Launch

if TYPE_CHECKING:
    from coliworker.kernels.matmul import WeightSpec

# Blocks of PF_SROWS activation rows (64 mma columns: bf16 hi and lo of each row). gemv_pf takes
# KS = 1 (every warp over all of K, PF_ROWS[1] weight rows per block) when that fills the GPU,
# else KS = 4 (k slices meeting in shared memory, 4x the blocks).
PF_SROWS = 32
PF_SMEM = 2 * PF_SROWS * (512 + 16) * 2  # the staged K tile: 64 bf16 columns (PF_SMEM)
PF_ROWS = {1: 256, 4: 64}  # gemv_pf weight rows per block by KS (PfTile<PF_MR, KS>::ROWS)
PF_MOE_ROWS = (128, 256)  # moe_pf rows per gate+up tile (hidden) and per down tile
PF_CLUSTERS = (2, 4, 8)  # gemv_pf_sk's cluster sizes (C = 1: gemv_pf)
PF_BLOCK_COST = 4  # a block's fixed cost (launch, first loads, reduction) in K tiles
PF_VARIANTS = (
    tuple(f"gemv_pf<{f}, {ks}>" for f in (2, 4) for ks in PF_ROWS)
    + tuple(f"moe_pf<{f}>" for f in (2, 4))
    + tuple(f"gemv_pf_sk<{f}, {ks}, {c}>" for f in (2, 4) for ks in PF_ROWS for c in PF_CLUSTERS)
)
# Split-K of the many-row gemv (gemv_pf_sk, prefill_tc.cu): where gemv_pf's grid would leave
# SMs idle (o_proj of 8-32 sequences: 24 tiles of 256 weight rows), a tile's K is split over a
# cluster of C blocks that meet in distributed shared memory in a fixed order (``_pf_choice``).
# ``PF_SPLIT_K`` off keeps gemv_pf's k slices (KS = 4) there; ``PF_SK_FORCE`` fixes (KS, C)
# (tests and bench/gemv_splitk.py). Measured on an H100 (bench/results/pf-split-k-2026-12-05.md):
# o_proj of 32 sequences 187.6 -> 79.2 us (C = 8), the value projection of 32 sequences
# 22.1 -> 17.1 us (KS = 1, no split). COLIWORKER_PF_SPLIT_K=0 sets it off from the start.
PF_SPLIT_K = os.environ.get("COLIWORKER_PF_SPLIT_K", "1") != "0"
PF_SK_FORCE: tuple[int, int] | None = None


def _pf_choice(spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int, n_sm: int
               ) -> tuple[int, int]:  # fmt: skip
    """(KS, C) of a many-row gemv launch: gemv_pf (C = 1) with KS = 1 where its blocks fill
    the GPU twice over; else, with ``PF_SPLIT_K``, KS = 1 and the cluster size C with the least
    modelled time, waves x (PF_BLOCK_COST + K tiles per rank) (``PF_SK_FORCE`` fixes both);
    without it KS = 4 (4x the blocks, k slices meeting in shared memory). Blocks of one launch
    run side by side and are latency bound: splitting pays while the grid leaves block slots
    empty and stops where it adds waves. On an H100 every KS = 4 form, split or not, measured
    slower than the best KS = 1 one (bench/results/pf-split-k-2026-12-05.md)."""
    if PF_SK_FORCE is not None:
        ks, c = PF_SK_FORCE
        if ks not in PF_ROWS or c not in (1, *PF_CLUSTERS):
            raise ValueError(f"PF_SK_FORCE={PF_SK_FORCE}: KS not in {tuple(PF_ROWS)} or C not "
                             f"in {(1, *PF_CLUSTERS)}")  # fmt: skip
        return ks, c
    tiles = -(-max_rows // PF_SROWS) * -(-max_out // PF_ROWS[1]) * n_jobs
    if tiles >= 2 * n_sm:
        return 1, 1
    if not PF_SPLIT_K:
        return 4, 1
    slots = (2 if spec.fmt == 2 else 1) * n_sm  # blocks per SM: gemv_pf's __launch_bounds__
    nb = -(-spec.in_features // 1024)  # int4 blocks of K (a rank's share is whole blocks)
    nt = -(-spec.in_features // 512)  # K tiles
    best = (0, 0)
    for c in (1, *PF_CLUSTERS):
        per_rank = nt if c == 1 else 2 * -(-nb // c)
        cost = -(-tiles * c // (slots // c * c)) * (PF_BLOCK_COST + per_rank)
        if best[1] == 0 or cost < best[0]:
            best = (cost, c)
    return 1, best[1]


def _gemv_pf(spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int, n_sm: int) -> Launch:
    """gemv_launch's launch on the tensor-core prefill path (same jobs, same pointer):
    gemv_pf, or gemv_pf_sk where ``_pf_choice`` splits K over a cluster."""
    from coliworker.kernels.matmul import WARPS

    nz = -(-max_rows // PF_SROWS)
    ks, c = _pf_choice(spec, n_jobs, max_rows, max_out, n_sm)
    name = f"gemv_pf<{spec.fmt}, {ks}>" if c == 1 else f"gemv_pf_sk<{spec.fmt}, {ks}, {c}>"
    fn = get_function("prefill_tc.cu", name, PF_VARIANTS)
    grid = (nz * c, -(-max_out // PF_ROWS[ks]), n_jobs)
    return Launch(fn, grid, (WARPS * 32,), spec.geom(), PF_SMEM)


def _moe_pf(
    gu: WeightSpec, dn: WeightSpec, n_jobs: int, max_rows: int, max_ie: int, max_dout: int,
    n_sm: int,
) -> Launch | None:  # fmt: skip
    """moe_launch's launch on the tensor-core prefill path (same arguments, same pointers)."""
    from coliworker.kernels.matmul import WARPS, _resident_blocks

    name = f"moe_pf<{gu.fmt}>"
    fn = get_function("prefill_tc.cu", name, PF_VARIANTS)
    nz = -(-max_rows // PF_SROWS)
    ta = -(-max_ie // PF_MOE_ROWS[0])
    tb = -(-max_dout // PF_MOE_ROWS[1])
    total = (ta + tb) * nz * n_jobs
    if total <= 0:
        return None
    blocks = min(total, _resident_blocks(fn, name, PF_SMEM, n_sm))
    tail = (np.int32(n_jobs), np.int32(ta), np.int32(tb), np.int32(nz), *gu.geom(), *dn.geom())
    return Launch(fn, (blocks,), (WARPS * 32,), tail, PF_SMEM)
