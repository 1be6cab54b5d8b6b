"""gemv_st's host side (kernel: ``kernels/gemv_stream.cuh``, compiled as part of gemv_tc.cu):
its switches (``STREAM``, ``ST_WARPS``, ``ST_BLOCKS``, ``ST_Q8``: set from the environment at
import), its geometry (``_st_geometry``: SB, ring stages, piece bytes, shared memory, math
warps), where it serves (``stream_eligible``) and its launch (``_gemv_st``). ``matmul.gemv_launch``
takes it for decode gemv jobs, ``kernels/expert_group.py`` for a streamed group's gate+up
(dual jobs) and down. Tests: ``tests/kernels/test_gemv_stream_cpu.py`` (its source on the CPU,
its geometry), ``test_gemv_splitk.py`` and ``test_expert_group.py`` (on a GPU).

``kernels/matmul.py`` imports this module (its ``settings()`` reads the switches here); what
this module uses of matmul (``TENSOR_CORES``, ``TC_MAX_ROWS``, ``tc_sb``, ``TC_VARIANTS``,
``gs_args``) it imports in the functions that use it, when called: no import cycle at load, and
the ``matmul.TENSOR_CORES`` a test sets is the one read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.launch import Launch

if TYPE_CHECKING:
    from coliworker.kernels.matmul import WeightSpec

# gemv_st (gemv_stream.cuh): decode gemv jobs of up to TC_MAX_ROWS rows, fmt 2 and fmt 4 with a
# power of two group size of 16..256, with the weights (and grouped scales) streamed by the
# bulk-copy engine through a ring of ST_STAGES shared-memory stages, one resident block per SM
# over a contiguous range of 16-row tiles, x staged once per block and job. Taken where the
# whole of K's staged x fits beside the ring. ``STREAM``: True takes it wherever it serves,
# False never, "auto" (the default) where bench/gemv_splitk.py measured it faster on the H200
# (bench/results/gemv-stream-2026-12-01.md): 2 to 4 rows (SB 4) of plain jobs of K >=
# ST_AUTO_MIN_K (dense S=4 6144 x 6144: 18.9 against 20.5 us in int4, 25.0 against 37.7 us
# with gs=64 scales); at one row it ties or loses (gs=128, o_proj), on the value projection's
# 64 small jobs it loses, and expert groups stay on moe_tc_f (74 against 86 us at 8x1).
# COLIWORKER_GEMV_STREAM=1 / 0 / auto sets it from the start (the GPU tests run every path,
# tests/kernels/test_gemv_stream_cpu.py runs its source on the CPU).
STREAM: bool | str = {"1": True, "0": False}.get(
    os.environ.get("COLIWORKER_GEMV_STREAM", "auto"), "auto"
)
ST_AUTO_MIN_K = 4096
ST_ROWS = 16
ST_PIECES = (1024, 512)  # bytes of a row per stage: the first that gives ST_STAGES[1] stages
ST_BARS = 16 * 8  # the mbarriers before the ring (ST_MAX_STAGES = 8)
ST_STAGES = (6, 3)  # stages wanted, fewest accepted
# Math warps per block (its k slices: 8 or 16; 16 only with 1024-byte pieces, whose 16 steps
# give each one) and blocks per SM (1 or 2; each then has half the SM's shared memory).
# COLIWORKER_ST_WARPS / COLIWORKER_ST_BLOCKS set them from the start.
ST_WARPS = int(os.environ.get("COLIWORKER_ST_WARPS", "8"))
ST_BLOCKS = int(os.environ.get("COLIWORKER_ST_BLOCKS", "1"))
ST_SMEM_SM = 228 * 1024  # shared memory of an SM; each resident block reserves 1 KiB of it
# gemv_st's integer path (its Q8 template argument, gemv_stream.cuh) for fmt 2 and fmt 4 with
# groups of 32 or more: the codes as u8 against each activation row scaled by a power of two
# and split in four int8 parts, exact int32 sums on the m16n8k32 tensor-core path (fmt 4: each
# mma's sum scaled by its group's); fewer instructions per weight byte than the bf16 path,
# other bits (within 1e-7 of float64 where the bf16 path is). Off until measured faster;
# COLIWORKER_ST_Q8=1 sets it from the start.
ST_Q8 = os.environ.get("COLIWORKER_ST_Q8", "0") == "1"


def _st_stage(spec: WeightSpec, dual: bool, pc: int) -> int:
    """Bytes of one gemv_st ring stage of pc-byte pieces: 16 rows of a piece per matrix (pc +
    64 bytes apart), and for fmt 4 their scales (st_scale_stride floats per row: the piece's
    2 * pc / gs, plus 4)."""
    scales = 4 * ST_ROWS * (2 * pc // spec.group_size + 4) if spec.fmt == 4 else 0
    return (2 if dual else 1) * (ST_ROWS * (pc + 64) + scales)


def _st_geometry(
    spec: WeightSpec, max_rows: int, dual: bool
) -> tuple[int, int, int, int, int] | None:
    """(SB, ring stages, piece bytes, dynamic shared bytes, math warps) of gemv_st, or None
    where the staged x of all of K and ST_STAGES[1] stages do not fit in a block's share of the
    SM's shared memory (ST_BLOCKS blocks per SM; dual: stages and partials of two matrices).
    Pieces of 1024 bytes, or of 512 where 1024-byte stages would not give ST_STAGES[1] of them
    (4 activation rows: x takes 12 bf16 columns of K); ST_WARPS math warps with 1024-byte
    pieces, 8 with 512."""
    from coliworker.kernels.matmul import tc_sb

    sb, m, q8 = tc_sb(max_rows), 2 if dual else 1, _st_q8(spec)
    nt = (4 * sb + 7) // 8 if q8 else (3 * sb + 7) // 8
    in_padded = spec.layout.in_padded
    room = min(227 * 1024, ST_SMEM_SM // ST_BLOCKS - 1024)
    for pc in ST_PIECES:
        mw = ST_WARPS if pc == 1024 else 8
        if q8:  # int8 parts of 4 columns per row, then st_q8_scratch
            xbytes = 4 * sb * (in_padded + 32) + 4 * (mw * sb + mw * 4 * sb + 4 * sb + sb)
        else:  # bf16 parts of 3 columns per row
            xbytes = 2 * 3 * sb * (in_padded + 16)
        rest = ST_BARS + 4 * m * mw * ST_ROWS * 8 * nt + xbytes
        stage = _st_stage(spec, dual, pc)
        ns = min(ST_STAGES[0], (room - rest) // stage)
        if ns >= ST_STAGES[1]:
            return sb, ns, pc, rest + ns * stage, mw
    return None


def _st_q8(spec: WeightSpec) -> bool:
    """Whether gemv_st runs its integer path (Q8) for this spec: ``ST_Q8`` on, fmt 2 or fmt
    4 with groups of 32 or more (an mma's 32 elements in one group)."""
    return ST_Q8 and (spec.fmt == 2 or (spec.fmt == 4 and spec.group_size >= 32))


def stream_eligible(spec: WeightSpec, max_rows: int, dual: bool = False) -> bool:
    """Whether gemv_st serves these jobs (and ``STREAM`` takes it: True, or "auto" for plain
    jobs of 2 to 4 rows and K >= ST_AUTO_MIN_K): fmt 2, or fmt 4 with a power of two group
    size of 16..256 (a piece's scales are whole 16-byte rows); dual: gate and up jobs."""
    from coliworker.kernels.matmul import TC_MAX_ROWS, TENSOR_CORES

    fmt, gs = spec.fmt, spec.group_size
    if not (STREAM and TENSOR_CORES and max_rows <= TC_MAX_ROWS):
        return False
    if STREAM == "auto" and (dual or max_rows == 1 or spec.layout.in_padded < ST_AUTO_MIN_K):
        return False
    if not (fmt == 2 or (fmt == 4 and 16 <= gs <= 256 and gs & (gs - 1) == 0)):
        return False
    return _st_geometry(spec, max_rows, dual) is not None


def _gemv_st(spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int, n_sm: int,
             dual: bool = False) -> Launch:  # fmt: skip
    """gemv_launch's launch on the streamed path (same jobs, same pointer): ST_BLOCKS blocks
    per SM, or one per tile where there are fewer tiles."""
    from coliworker.kernels.matmul import TC_VARIANTS, gs_args

    lay = spec.layout
    geo = _st_geometry(spec, max_rows, dual)
    assert geo is not None
    sb, ns, pc, smem, mw = geo
    ntr, nz = -(-max_out // ST_ROWS), -(-max_rows // sb)
    name = f"gemv_st<{spec.fmt}, {sb}, {'true' if dual else 'false'}, {mw}"
    name += ", true>" if _st_q8(spec) else ">"
    fn = get_function("gemv_tc.cu", name, TC_VARIANTS, smem)
    if ST_BLOCKS > 1:  # all of the SM's shared memory (the driver sizes it for one block)
        fn.preferred_shared_memory_carveout = 100
    gs, shift = gs_args(spec.fmt, spec.group_size)
    tail = (np.int32(n_jobs), np.int32(ntr), np.int32(nz), np.int32(spec.in_features),
            np.int32(lay.in_padded), np.int32(lay.ld), np.int32(max(lay.ngp, 1)), gs, shift,
            np.int32(ns), np.int32(pc))  # fmt: skip
    return Launch(fn, (min(ST_BLOCKS * n_sm, n_jobs * ntr * nz),), ((mw + 1) * 32,), tail, smem)
